"""Build the Lightning `Trainer` from the `trainer:` section and run `fit`."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from framework.callbacks import builtin_callbacks, user_callbacks
from framework.errors import FwError
from framework.metrics import JsonlLogger
from framework.recipe import Requirements, recipe_class


def build_loggers(cfg: dict) -> list[Logger]:
    """metrics.jsonl always; CSV and TensorBoard under `<run_dir>/logs/` when enabled."""
    run_dir = Path(cfg["run_dir"])
    loggers: list[Logger] = [JsonlLogger(run_dir / "metrics.jsonl", name=cfg["name"])]
    if cfg["logging"]["csv"]:
        loggers.append(CSVLogger(save_dir=run_dir, name="logs", version=None))
    if cfg["logging"]["tensorboard"]:
        loggers.append(TensorBoardLogger(save_dir=run_dir, name="logs", version=None, default_hp_metric=False))
    return loggers


def _check_precision(cfg: dict, requirements: Requirements) -> None:
    """Refuse precision settings that would run but compute the wrong thing."""
    t = cfg["trainer"]
    cuda = t["accelerator"] in ("gpu", "cuda") or (t["accelerator"] == "auto" and torch.cuda.is_available())
    if cuda and t["precision"] == "64-true":
        raise FwError("trainer.precision: 64-true runs on the CPU only (the CUDA kernels take bf16, fp16 and "
                      "fp32); set trainer.accelerator: cpu or another precision")
    if t["precision"] == "16-mixed" and cfg["optimizer"]["fused"] is True:
        raise FwError("optimizer.fused: true cannot be combined with trainer.precision: 16-mixed (a fused "
                      "AdamW unscales inside its step, after fw clips the gradients); use auto or false")
    why = requirements.unsupported_precisions.get(t["precision"])
    if why is not None:
        raise FwError(f"trainer.precision: {t['precision']} is not supported by recipe {cfg['recipe']} ({why})")


def _strategy(cfg: dict, requirements: Requirements) -> str:
    """`trainer.strategy`, with DDP told to look for unused parameters when the recipe needs it."""
    strategy = cfg["trainer"]["strategy"]
    if requirements.find_unused_parameters and strategy == "ddp":
        return "ddp_find_unused_parameters_true"
    return strategy


def build_trainer(cfg: dict) -> lightning.Trainer:
    """A `lightning.Trainer` for `cfg`: `trainer:` settings, loggers, built-in + user callbacks, checkpoints.

    Gradient accumulation is Lightning's only under automatic optimization; manual recipes accumulate
    over their own micro-batches. Clipping is done by the module (`optimizer.max_grad_norm`) in both modes.
    """
    from framework.checkpoint import AtomicCheckpointIO, CheckpointCallback

    t = cfg["trainer"]
    requirements = recipe_class(cfg["recipe"]).requirements(cfg)
    automatic = requirements.automatic_optimization
    _check_precision(cfg, requirements)
    # Metrics first so they reach the loggers before the checkpoint callback flushes them and saves.
    callbacks = [*builtin_callbacks(cfg), *user_callbacks(cfg), CheckpointCallback(cfg)]
    return lightning.Trainer(
        accelerator=t["accelerator"],
        devices=t["devices"],
        num_nodes=t["num_nodes"],
        strategy=_strategy(cfg, requirements),
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


def fit(cfg: dict, resume: str | None = None, skip_damaged: bool = False) -> lightning.Trainer:
    """Train `cfg` (a resolved config): seed, write `<run_dir>/config.yaml`, build, fit.

    `resume`: None (fresh run), "last" (the newest complete checkpoint under run_dir; FwError if none)
    or a checkpoint directory; `skip_damaged` passes over damaged newest checkpoints (reported on stderr)
    instead of refusing. A changed setting that a resume cannot apply is refused before anything is written.
    """
    from framework.checkpoint import resolve_resume
    from framework.config import save_resolved
    from framework.module import FwModule

    lightning.seed_everything(cfg["seed"], workers=True, verbose=False)
    ckpt_path = resolve_resume(resume, cfg, skip_damaged)
    if rank_zero_only.rank == 0:
        save_resolved(cfg, Path(cfg["run_dir"]) / "config.yaml")
    trainer = build_trainer(cfg)   # first: it refuses unsupported settings before the models are built
    module = FwModule(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer
