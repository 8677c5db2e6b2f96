"""Lightning's side of checkpointing: the CheckpointIO plugin and the callback that decides when to save."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.io import CheckpointIO

from framework.cadence import crossed
from framework.checkpoint.directory import SOURCE_GENERATION_CONFIG, read_checkpoint_dir, write_checkpoint_dir
from framework.checkpoint.resume import source_fingerprints
from framework.checkpoint.store import (
    checkpoints_dir,
    clean_leftovers,
    prune,
    refuse_existing_checkpoints,
    step_dir_name,
)
from framework.console import say
from framework.durable import remove_tree
from framework.errors import FwError
from framework.models.hf_io import GENERATION_CONFIG
from framework.optim import allow_optimizer_states

# Saves of at least this many bytes are reported on stderr (size, the write's speed, the whole save's time);
# smaller ones take moments and stay quiet.
REPORT_BYTES = 1 << 30


def read_source_generation_config(path: str | None) -> bytes | None:
    """The bytes of the generation_config.json of model directory `path`; None for a preset (no path) or a
    directory without one."""
    if path is None:
        return None
    try:
        return (Path(path) / GENERATION_CONFIG).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


class AtomicCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO writing fw checkpoint directories (the format: `framework.checkpoint`).

    Every checkpoint it writes keeps the generation_config.json of the model directory the run started from
    (`model.policy.path`), read when the run starts, or on a resume taken from the checkpoint it resumes: the
    directory may change or go before a later checkpoint is written or exported."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.last_write: tuple[int, float] | None = None   # (bytes, seconds) of the newest write
        # the checkpoint loaded for a resume, from its load until training starts (CheckpointCallback), while
        # Lightning restores its states: a failure then may come of a corrupt file that read without an error
        self.restoring: Path | None = None
        self.generation_config = read_source_generation_config(cfg["model"]["policy"]["path"])

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        # what the config's data and model paths hold, hashed once per process (resume.py): before the clock of
        # the write's speed starts
        sources = source_fingerprints(self.cfg)
        start = time.perf_counter()
        if self.generation_config is not None:
            checkpoint[SOURCE_GENERATION_CONFIG] = self.generation_config
        manifest = write_checkpoint_dir(checkpoint, path, self.cfg, sources=sources)
        self.last_write = (sum(f["size"] for f in manifest["files"].values()), time.perf_counter() - start)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        allow_optimizer_states(self.cfg)   # torchao's 8-bit state tensors, for a weights-only load
        try:
            checkpoint = read_checkpoint_dir(
                path, map_location=map_location, weights_only=weights_only, verify=self.cfg["checkpoint"]["verify"]
            )
        except Exception:
            # resolve_resume found it complete: gone since, it was pruned by the run that wrote it (a resume from
            # another, live run), which no damage message would say
            if not Path(path).is_dir():
                raise FwError(f"--resume: the checkpoint {path} was deleted while this run read it, pruned by the "
                              "run writing it; no step was taken: run again, naming a checkpoint that run keeps "
                              "or its run directory (its newest)") from None
            raise
        carried = checkpoint.pop(SOURCE_GENERATION_CONFIG, None)
        if carried is not None:   # the source as the resumed run found it; without a copy, what it holds now
            self.generation_config = carried
        self.restoring = Path(path)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        remove_tree(Path(path))


class CheckpointCallback(pl.Callback):
    """Saves `<run_dir>/checkpoints/step-%06d` every `checkpoint.every_n_steps` policy optimizer steps and at
    the end of fit, flushing every logger first, then prunes to `checkpoint.keep_last`.

    The step is the module's `policy_version` when it has one (it moves between the optimizer-step hooks
    in both optimization modes, whereas Lightning updates global_step at different points in each),
    else `trainer.global_step`. A save happens only in a batch where the step advanced, so never in the
    middle of gradient accumulation.
    """

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.every = cfg["checkpoint"]["every_n_steps"]
        self.keep_last = cfg["checkpoint"]["keep_last"]
        self.max_steps = cfg["trainer"]["max_steps"]  # policy optimizer steps in every recipe (docs/DESIGN.md)
        self.ckpt_dir = checkpoints_dir(cfg["run_dir"])
        self._seen_step: int | None = None
        self._last_saved: int | None = None

    @property
    def last_saved(self) -> int | None:
        """The step of the newest checkpoint this run saved or resumed from (None before either)."""
        return self._last_saved

    @staticmethod
    def step_of(trainer: pl.Trainer, module: pl.LightningModule) -> int:
        version = getattr(module, "policy_version", None)
        return int(version) if version is not None else int(trainer.global_step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO):   # every state is restored by now
            io.restoring = None
        step = self.step_of(trainer, pl_module)
        self._seen_step = step
        if trainer.ckpt_path is not None:  # set by now under every strategy
            self._last_saved = step
        else:
            # every rank checks (a shared run_dir), so all of them stop together rather than leaving some
            # waiting in a collective; only rank 0 touches the directory
            refuse_existing_checkpoints(self.cfg["run_dir"])

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here rather than at train start: resuming a run that had reached max_steps (killed while it pruned,
        # say) trains no step and never starts training, and its leftovers must go all the same.
        if trainer.is_global_zero:
            clean_leftovers(self.ckpt_dir)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self.step_of(trainer, pl_module)
        previous, self._seen_step = self._seen_step, step
        if previous is None or step == previous:
            return
        if crossed(previous, step, self.every) or step >= self.max_steps > 0 or trainer.should_stop:
            self.save(trainer, step)   # should_stop: the last step of a run that stops early (e.g. on SIGTERM)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = self.step_of(trainer, pl_module)
        if step > 0 and step != self._last_saved:
            self.save(trainer, step)

    def save(self, trainer: pl.Trainer, step: int) -> None:
        # a save's time is not training time: FwModule leaves it out of tokens_per_s
        with getattr(trainer.lightning_module, "off_the_clock", contextlib.nullcontext)():
            self._save(trainer, step)

    def _save(self, trainer: pl.Trainer, step: int) -> None:
        for logger in trainer.loggers:
            logger.save()
        start = time.perf_counter()
        trainer.save_checkpoint(self.ckpt_dir / step_dir_name(step), weights_only=False)
        total = time.perf_counter() - start
        self._last_saved = step
        if trainer.is_global_zero:
            prune(self.cfg["run_dir"], self.keep_last)
            io = trainer.strategy.checkpoint_io
            if isinstance(io, AtomicCheckpointIO) and io.last_write is not None and io.last_write[0] >= REPORT_BYTES:
                # the write against the whole save (which also gathers the states): where a slow save's time goes
                size, seconds = io.last_write
                shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
                say(f"fw: saved {step_dir_name(step)}: {shown} written in {seconds:.1f} s "
                    f"({size / 1e9 / max(seconds, 1e-9):.2f} GB/s), {total:.1f} s with gathering the states",
                    flush=True)
