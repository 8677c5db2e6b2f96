"""A user callback on fw's optimizer-step hooks: the wall time of every policy step.

Add it to a config as `callbacks: [{class_path: examples.step_timer.StepTimer}]` (from the repository root);
`python -m benchmarks.fit_timing` adds it itself and summarises what it wrote.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from framework.callbacks import Callback


class StepTimer(Callback):
    """Wall time between consecutive policy optimizer steps, written to <run_dir>/step_times.json."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_start(self, trainer, module) -> None:
        self._sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.stamps = [time.perf_counter()]

    def after_optimizer_step(self, trainer, module, optimizer) -> None:
        if module.optimizer_role(optimizer) != "policy":
            return
        self._sync()
        self.stamps.append(time.perf_counter())
        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
        out = Path(trainer.default_root_dir) / "step_times.json"
        out.write_text(json.dumps({"step_seconds": [b - a for a, b in zip(self.stamps, self.stamps[1:])],
                                   "peak_gib": peak, "reserved_gib": reserved, "last_step_at": time.time()}))

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
