"""Python's garbage-collector pauses inside each training step of an `fw fit` run (`GCPauses`), and `gc.freeze()` at
the start of training (`FreezeAtStart`), to tell whether collections add to a step's host time.

    python -m benchmarks.grpo_step --run_dir=/tmp/runs/gc --trainer.max_steps=6 \\
        "--callbacks=[{class_path: benchmarks.gc_pauses.GCPauses}]"
    python -m benchmarks.grpo_step --run_dir=/tmp/runs/gc-frozen --trainer.max_steps=6 \\
        "--callbacks=[{class_path: benchmarks.gc_pauses.GCPauses}, {class_path: benchmarks.gc_pauses.FreezeAtStart}]"

Each training batch prints one line: its wall seconds and, for each generation, the collections that ran inside it
and their seconds.
"""
from __future__ import annotations

import gc
import time
from typing import Any

import lightning


class GCPauses(lightning.Callback):
    """Times every collection (`gc.callbacks`) and charges it to the training batch it ran in."""

    def __init__(self) -> None:
        self.steps: list[dict] = []     # per batch: "seconds", and "gen0".."gen2": [collections, seconds]
        self._pauses: list[tuple[int, float]] = []
        self._started: float | None = None
        self._batch_start: float | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None and self._batch_start is not None:
            self._pauses.append((info["generation"], time.perf_counter() - self._started))

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        gc.callbacks.append(self._on_gc)

    def on_train_end(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def on_train_batch_start(self, trainer: lightning.Trainer, module: lightning.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._pauses.clear()
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step: dict = {"seconds": time.perf_counter() - self._batch_start}
        for g in range(3):
            ds = [d for gen, d in self._pauses if gen == g]
            step[f"gen{g}"] = [len(ds), sum(ds)]
        self._batch_start = None
        self.steps.append(step)
        print(f"gc_pauses batch {len(self.steps) - 1}: {step['seconds']:.3f} s; " + ", ".join(
            f"gen{g} {step[f'gen{g}'][0]} x {1e3 * step[f'gen{g}'][1]:.1f} ms" for g in range(3)), flush=True)


class FreezeAtStart(lightning.Callback):
    """Collects once, then freezes everything alive when training starts (model, data, framework), so that later
    collections traverse only what the steps allocate."""

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        gc.collect()
        gc.freeze()
