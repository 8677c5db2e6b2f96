"""Build the Lightning `Trainer` from the `trainer:` section and run `fit`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar as LightningProgressBar
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_only

from framework.allocator import configure_allocator
from framework.callbacks import (
    EvalCallback,
    FlushOnEarlyStop,
    MetricsLogger,
    RestorableState,
    StopAfterSave,
    StopEveryRankOnError,
    StopOnSignal,
    builtin_callbacks,
    user_callbacks,
)
from framework.console import hand_started_node, last_resort_above_bars
from framework.errors import FwError
from framework.evaluation import eval_enabled
from framework.loggers import build_loggers, earlier_logs, log_config, quiet_event_writer_threads
from framework.metrics import check_resumable
from framework.precision import check_precision
from framework.recipe import Requirements, recipe_class
from framework.run_lock import RunLock, refuse_another_run
from framework.signals import Interrupted, Stopped, StopSignals, signal_name

# Lightning's messages a user of fw cannot act on: fw picks the Trainer's settings itself, keeps the
# frozen reference model in eval mode on purpose, and reads its data from an endless stream.
UNACTIONABLE_WARNINGS = (
    r"GPU available but not used",
    r"TPU available but not used",
    r"Found \d+ module\(s\) in eval mode",
    r".*does not have many workers",
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",
)
# Loggers of Lightning's info lines: device banners, tips, "`Trainer.fit` stopped: `max_steps` reached".
# The signal connector's: its SLURM auto-requeue line (fw handles SIGUSR1 itself) and "Received SIGTERM" beside fw's.
QUIET_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.accelerators.cuda", "lightning.fabric.utilities.distributed",
                 "lightning.pytorch.trainer.connectors.signal_connector")


class KeepOnDevice(SingleDeviceStrategy):
    """Lightning's one-device strategy, except that the end of `fit` leaves the models and the optimizer states
    where they trained. Lightning's teardown copies them into host memory, which takes time and host memory in
    proportion to their size, for a process that exits next, as `fw fit` does."""

    def teardown(self) -> None:
        # Strategy.teardown without its two moves to the CPU
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


class SaveConfig(lightning.Callback):
    """Writes the resolved config to `<run_dir>/config.yaml` (global rank 0, atomically) as the first step begins:
    after everything that can refuse the run at start-up (the loggers, the processes' start, the models, the
    checkpoint's restore, the callbacks' and the data's set-up), so that a refused run leaves the config.yaml of
    the run before it as it was. A run that takes no step (resumed at `trainer.max_steps`) writes it as it ends."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.saved = False

    def on_train_batch_start(self, trainer: lightning.Trainer, module: lightning.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._save(trainer)

    def on_fit_end(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        self._save(trainer)

    def _save(self, trainer: lightning.Trainer) -> None:
        if self.saved:
            return
        self.saved = True
        if trainer.is_global_zero:
            from framework.config import save_resolved

            save_resolved(self.cfg, Path(self.cfg["run_dir"]) / "config.yaml")


class SameCheckpointOnEveryRank(lightning.Callback):
    """Refuses a multi-process run whose processes resolved `--resume` to different checkpoints, before any is
    restored: each node resolves it on its own (the processes Lightning starts on a node take their launcher's,
    `pin_resume`), and a node that sees other files, or a run that publishes a newer checkpoint between two nodes'
    starts, would otherwise train every rank from another state. Checkpoints are compared by the bytes of their
    manifest (every file's size and sha256), so one copied alike to each node's own disk agrees."""

    def __init__(self, checkpoint: str | None):
        self.checkpoint = checkpoint

    def setup(self, trainer: lightning.Trainer, module: lightning.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, (self.checkpoint, _checkpoint_identity(self.checkpoint)))
        others = [rank for rank, (_, ident) in enumerate(found) if ident != found[0][1]]
        if not others:
            return

        def named(rank: int) -> str:
            return f"global rank {rank} {found[rank][0] or 'no checkpoint (a fresh start)'}"

        same = " (the same path, other content)" if found[others[0]][0] == found[0][0] else ""
        error = FwError(f"--resume: the processes resolved different checkpoints: {named(0)}, "
                        f"{named(others[0])}{same}; every process must start from one, so pass --resume with the path "
                        "of a checkpoint that every node reads alike")
        error.every_rank = True   # every rank raises it; global rank 0 says it
        error.quiet = trainer.global_rank != 0
        raise error


def _checkpoint_identity(checkpoint: str | None) -> str | None:
    """What tells one checkpoint from another across nodes: its manifest's sha256, else its resolved path."""
    from framework.checkpoint import MANIFEST

    if checkpoint is None:
        return None
    manifest = Path(checkpoint) / MANIFEST
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    return str(Path(checkpoint).resolve())


def _number_this_process(cfg: dict) -> None:
    """Give Lightning's rank_zero_only the global rank Lightning will give this process, before Lightning does.
    A job started by hand on each node (NODE_RANK set, no launcher's RANK) has rank NODE_RANK x processes a node +
    LOCAL_RANK, where Lightning's guess at import says 0 on every node's first process: each would lock run_dir,
    print and write as the first process."""
    from framework.config import world_size

    node = hand_started_node()
    if node > 0:
        per_node = world_size(cfg) // cfg["trainer"]["num_nodes"]
        rank_zero_only.rank = node * per_node + int(os.environ.get("LOCAL_RANK") or 0)


def _one_device(cfg: dict) -> torch.device | None:
    """The device of a job that runs as one process on the CPU or one CUDA device, or None (several processes,
    another accelerator, or a strategy named in the config)."""
    from framework.config import world_size

    t = cfg["trainer"]
    if t["strategy"] != "auto":
        return None
    if t["accelerator"] == "cpu":
        backend = "cpu"
    elif t["accelerator"] in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        backend = "cuda"
    else:   # another accelerator, or the one Lightning picks for "gpu" or "auto" without CUDA (Apple's, XLA's)
        return None
    if world_size(cfg, backend) != 1:
        return None
    if backend == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", t["devices"][0] if isinstance(t["devices"], list) else 0)


def _strategy(cfg: dict, requirements: Requirements, keep_on_device: bool = False) -> str | SingleDeviceStrategy:
    """`trainer.strategy`, with DDP told to look for unused parameters when the recipe needs it; with
    `keep_on_device`, a one-process job's strategy is KeepOnDevice."""
    strategy = cfg["trainer"]["strategy"]
    if requirements.find_unused_parameters and strategy == "ddp":
        return "ddp_find_unused_parameters_true"
    device = _one_device(cfg) if keep_on_device else None
    return KeepOnDevice(device) if device is not None else strategy


def build_trainer(cfg: dict, stop: StopSignals | None = None, keep_on_device: bool = False,
                  checkpoint: str | None = None) -> lightning.Trainer:
    """A `lightning.Trainer` for `cfg`: `trainer:` settings, loggers, built-in + user callbacks, checkpoints;
    with `stop`, a signal ends training at the end of the step in progress; `keep_on_device`: see `fit`;
    `checkpoint`: the one this process resumes from, which every process of the job must agree on.

    Gradient accumulation is Lightning's only under automatic optimization; manual recipes accumulate
    over their own micro-batches. Clipping is done by the module (`optimizer.max_grad_norm`) in both modes.
    """
    from framework.checkpoint import AtomicCheckpointIO, CheckpointCallback

    t = cfg["trainer"]
    requirements = recipe_class(cfg["recipe"]).requirements(cfg)
    automatic = requirements.automatic_optimization
    check_precision(cfg, requirements)
    # Metrics first so they reach the loggers before the checkpoint callback flushes them and saves; the
    # evaluation of a step ahead of both, so its metrics join the step's record and a resumed run never
    # misses one; the non-finite check ahead of all three, so a diverged step is neither evaluated, logged
    # nor saved; after the user callbacks, which may stop the run (on one rank only), every rank's agreement
    # to stop, then its last steps' record, then the check of what the user callbacks save, then the save, then a
    # stop for a signal that came during that save. A failure of one rank is told to the others first, while
    # nothing else has run on its way out.
    evaluation = [EvalCallback(cfg)] if eval_enabled(cfg) else []
    user = user_callbacks(cfg)
    own_bar = not any(isinstance(cb, LightningProgressBar) for cb in user)   # a user's bar replaces fw's
    builtin = builtin_callbacks(cfg, evaluation, progress_bar=own_bar)
    metrics = next(cb for cb in builtin if isinstance(cb, MetricsLogger))
    saver = CheckpointCallback(cfg)
    callbacks = [StopEveryRankOnError(), SameCheckpointOnEveryRank(checkpoint), SaveConfig(cfg), *builtin, *user,
                 StopOnSignal(stop), FlushOnEarlyStop(metrics, stop), RestorableState(cfg["callbacks"], user),
                 saver, StopAfterSave(stop, lambda: saver.last_saved)]
    return lightning.Trainer(
        accelerator=t["accelerator"],
        devices=t["devices"],
        num_nodes=t["num_nodes"],
        strategy=_strategy(cfg, requirements, keep_on_device),
        precision=t["precision"],
        max_steps=t["max_steps"],
        max_epochs=-1,
        accumulate_grad_batches=t["accumulate_grad_batches"] if automatic else 1,
        log_every_n_steps=t["log_every_n_steps"],
        enable_progress_bar=t["enable_progress_bar"],
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=cfg["run_dir"],
        logger=build_loggers(cfg),
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO(cfg)],
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )


def build_device(trainer: lightning.Trainer) -> torch.device:
    """Where the models are built: this process's accelerator when the strategy keeps a whole model per
    device (one device, DDP), the CPU when it shards (FSDP wraps and moves a CPU model itself)."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = trainer.strategy
    return strategy.root_device if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) else torch.device("cpu")


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Hide Lightning's warnings and info lines that a user of fw cannot act on; the rest pass."""
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with warnings.catch_warnings():
        for message in UNACTIONABLE_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        try:
            for name in QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def refuse_earlier_metrics(run_dir: str | Path) -> None:
    """FwError if a fresh run would write into the metrics.jsonl or the CSV / TensorBoard logs of an earlier one
    (which left no checkpoint: a run_dir with checkpoints is refused before this, with --resume last as the way
    on)."""
    path = Path(run_dir) / "metrics.jsonl"
    logged = earlier_logs(run_dir)   # the CSV and TensorBoard logs a resume continues, a fresh run must not
    if path.is_file() and path.read_text(encoding="utf-8", errors="replace").strip():
        also = f" and {logged.parent}" if logged is not None else ""   # all that a fresh start needs gone, at once
        raise FwError(f"{path} holds the metrics of an earlier run, which left no checkpoint to resume from; "
                      f"choose another run_dir, or delete the file{also} to start over")
    if logged is not None:
        raise FwError(f"{logged} holds the logs of an earlier run, which left no checkpoint to resume from; "
                      f"choose another run_dir, or delete {logged.parent} to start over")


def fit(cfg: dict, resume: str | None = None, skip_damaged: bool = False,
        keep_on_device: bool = False, signals_until_exit: bool = False) -> lightning.Trainer:
    """Train `cfg` (a resolved config): lock run_dir, check its memory plan, seed, build, fit; `<run_dir>/config.yaml`
    is written as the first step begins (`SaveConfig`), so a run refused at start-up leaves it as it was.

    `resume`: None (fresh run), "last" (the newest complete checkpoint under run_dir; FwError if none)
    or a checkpoint directory; `skip_damaged` passes over damaged newest checkpoints (reported on stderr)
    instead of refusing. A changed setting that a resume cannot apply is refused before anything is written.
    SIGTERM / SIGINT finish the current step, publish its checkpoint and raise `framework.signals.Stopped`
    (framework/signals.py has the rules). `keep_on_device`: a one-process job leaves its models and optimizer
    states on the device at the end instead of copying them to host memory (for a caller that exits next).
    `signals_until_exit`: the process ends after fit, whose signal handlers stay in place, so that a signal while it
    exits still gets its line.
    """
    from framework.checkpoint import (
        find_latest,
        in_run_dir,
        pin_resume,
        refuse_missing_run_dir,
        resolve_resume,
        resume_refusal,
    )
    from framework.memory_plan import check_fits
    from framework.module import FwModule

    configure_allocator()   # before the first CUDA allocation: it decides how segments are mapped
    _number_this_process(cfg)
    # before anything is written or built: a job that cannot fit is refused now, not an hour in; the table
    # of one that fits is printed once the run is sure to start (a busy run_dir or a refused resume gets
    # its one line only)
    plan = check_fits(cfg, rank_zero_only.rank, show=False)
    run_dir = Path(cfg["run_dir"])
    rank0 = rank_zero_only.rank == 0
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(StopSignals(cfg["trainer"]["stop_grace_s"], until_exit=signals_until_exit))
        refuse_missing_run_dir(resume, run_dir)   # before the lock creates it
        if rank0:   # the other processes of a multi-process run share it with rank 0
            stack.enter_context(RunLock(run_dir))
        else:   # before the process group, which would keep them waiting on a rank 0 that a busy run_dir ended
            refuse_another_run(run_dir)
        ckpt_path = resolve_resume(resume, cfg, skip_damaged)
        stack.enter_context(pin_resume(cfg["run_dir"], resume, ckpt_path))
        lightning.seed_everything(cfg["seed"], workers=True, verbose=False)
        if ckpt_path is None or not in_run_dir(run_dir, ckpt_path):
            # a fresh run, or one resumed from another directory's checkpoint (whose run_dir holds no checkpoint,
            # resolve_resume saw to that), must not write into an earlier run's metrics: on every rank, so that all
            # of them stop together
            refuse_earlier_metrics(run_dir)
        else:
            # the resume drops the lines past its checkpoint at its first record: a line it cannot place is
            # refused now, before a step is spent, on every rank so that all of them stop together
            check_resumable(run_dir / "metrics.jsonl")
        if rank0:
            print(plan.table(), file=sys.stderr, flush=True)
        stack.enter_context(quiet_lightning())
        stack.enter_context(last_resort_above_bars())   # fw's reward warnings are logging records
        stack.enter_context(quiet_event_writer_threads())
        # first: it refuses unsupported settings before the models are built
        trainer = build_trainer(cfg, stop, keep_on_device, checkpoint=ckpt_path)
        module = FwModule(cfg, device=build_device(trainer))
        stop.state = lambda saving: _published(run_dir, module.policy_version, trainer.max_steps, saving)
        log_config(trainer.loggers, cfg)
        try:
            trainer.fit(module, ckpt_path=ckpt_path)
        except Interrupted as e:   # a reward's KeyboardInterrupt (framework/rewards.py), named by its sample
            raise _interrupted(module.policy_version, run_dir, f"KeyboardInterrupt in {e.what}") from e
        except SystemExit as e:
            # Lightning ends a fit that meets a KeyboardInterrupt with sys.exit(1) and no line; one raised by other
            # user code (a callback, a task) is reported as a reward's is, with where it was raised
            if not isinstance(e.__context__, KeyboardInterrupt):
                raise
            frames = traceback.extract_tb(e.__context__.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            raise _interrupted(module.policy_version, run_dir, f"KeyboardInterrupt raised{where}") from e.__context__
        except Exception as e:
            # a checkpoint that fails to load or restore (checkpoint.verify: false reads it unhashed): one line
            # naming its damaged file, with --skip-damaged where that passes over it
            if ckpt_path is not None and not isinstance(e, Stopped) and not (isinstance(e, FwError) and e.quiet):
                restoring = getattr(trainer.strategy.checkpoint_io, "restoring", None) is not None
                refusal = resume_refusal(e, ckpt_path, resume, skip_damaged, restoring)
                if refusal is not None:
                    raise refusal from None
            if not isinstance(e, (FwError, Stopped)):
                # a bug (fw's or the user's) keeps its traceback, which ends with what the run kept
                try:
                    kept = _since_newest(run_dir)
                except (OSError, FwError) as unread:   # the error stays the one to report
                    kept = f"its checkpoints could not be listed ({unread})"
                _note(e, f"fw: the run ended at step {module.policy_version} on this error; {kept}")
            raise
        stop.ended()   # what follows reports the outcome; under the fw program a signal now exits at once, saying so
        if stop.signum is not None and module.policy_version < trainer.max_steps:
            latest = find_latest(run_dir)
            saved = f"checkpoint {latest}; continue with {continue_command(run_dir)}" if latest else "no checkpoint"
            raise Stopped(stop.signum, f"stopped by {signal_name(stop.signum)} after step {module.policy_version}; "
                                       f"{saved}")
        if stop.signum is not None and rank0:   # in the last step or after it: its "finishing" line needs an end
            print(f"fw: {signal_name(stop.signum)} came as the run ended: it reached trainer.max_steps "
                  f"{trainer.max_steps}; its newest checkpoint is {find_latest(run_dir)}, nothing is lost",
                  file=sys.stderr, flush=True)
        elif module.policy_version < trainer.max_steps and rank0:   # a callback set trainer.should_stop: exit 0
            latest = find_latest(run_dir)
            saved = f"checkpoint {latest}; {continue_command(run_dir)} continues" if latest else "no checkpoint"
            print(f"fw: stopped at step {module.policy_version} of trainer.max_steps {trainer.max_steps}: a callback "
                  f"asked to (trainer.should_stop); {saved}", file=sys.stderr, flush=True)
    return trainer


def continue_command(run_dir: Path) -> str:
    """The command that continues a stopped run as it ran: its config.yaml (written before its first step) holds
    every override it was started with, which its config file alone does not, and a resume from that file would
    apply the settings the overrides changed back to the file's."""
    return f"fw fit --config {shlex.quote(str(run_dir / 'config.yaml'))} --resume last"


def _published(run_dir: Path, step: int, max_steps: int, saving: bool) -> str:
    """What a run at policy step `step` has published, for the line of an exit at once as the run ends: its newest
    complete checkpoint and the command that continues it; `saving`: an exit cuts the final save short. Read only:
    `find_latest` would first put back a checkpoint set aside by a replace, which may be this process's own save."""
    from framework.checkpoint import list_checkpoints

    complete = list_checkpoints(run_dir)
    if not complete:
        return "no checkpoint is published" + (f" (the save of step {step} is cut short)" if saving and step else "")
    latest = Path(complete[-1])
    reached = int(latest.name.removeprefix("step-"))   # step_dir_name's
    if reached >= step >= max_steps:
        return (f"it reached trainer.max_steps {max_steps}; its final checkpoint {latest} and the metric files up to "
                "it are written")
    go_on = f"continue with {continue_command(run_dir)}"
    if reached >= step:
        return f"its newest checkpoint {latest} (step {reached}) and the metric files up to it are written; {go_on}"
    cut = f"the save of step {step} is cut short and publishes nothing" if saving else f"step {step} is not saved"
    return f"{cut}; the newest intact checkpoint is {latest} (step {reached}); {go_on}"


def _interrupted(step: int, run_dir: Path, what: str) -> Stopped:
    """The stop of a fit that user code's KeyboardInterrupt ended at `step`: what the run did since its newest
    checkpoint is lost (the step in progress, or an evaluation after a step whose checkpoint comes after it)."""
    return Stopped(signal.SIGINT, f"interrupted at step {step}: {what}; {_since_newest(run_dir)}")


def _since_newest(run_dir: Path) -> str:
    """What a run that ended mid-way kept: its newest checkpoint and the command that continues from it."""
    from framework.checkpoint import find_latest

    latest = find_latest(run_dir)
    return (f"the newest checkpoint is {latest}, and what came after it is not saved; continue with "
            f"{continue_command(run_dir)}" if latest else "no checkpoint is saved")


def _note(e: BaseException, line: str) -> None:
    """`line` printed after e's traceback (a note, Python 3.11+), or on stderr before it."""
    if hasattr(e, "add_note"):
        e.add_note(line)
    else:
        print(line, file=sys.stderr, flush=True)
