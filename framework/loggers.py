"""The run's loggers: metrics.jsonl always, CSV and TensorBoard when enabled, and `logging.loggers`.

A user logger is any `lightning.pytorch.loggers.Logger` named by `class_path` and built with `init_args`
(W&B, MLflow, Comet, ...). When its class takes a `save_dir` and `init_args` sets none, it writes under
`<run_dir>/logs/<name>` (`WandbLogger` -> `logs/wandb`), with the run's other logs instead of the working
directory. Every logger receives the resolved config as hyperparameters (`log_config`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from framework.errors import FwError
from framework.metrics import JsonlLogger


def _default_save_dir(cls: type, run_dir: Path) -> Path:
    name = cls.__name__.removesuffix("Logger").lower() or cls.__name__.lower()
    return run_dir / "logs" / name


def user_loggers(cfg: dict) -> list[Logger]:
    """`logging.loggers: [{class_path, init_args}]` instantiated; each must be a Lightning `Logger`."""
    from framework.imports import import_object

    out = []
    for i, spec in enumerate(cfg["logging"]["loggers"]):
        cls = import_object(spec["class_path"])
        init_args = dict(spec.get("init_args") or {})
        if not (isinstance(cls, type) and issubclass(cls, Logger)):
            raise FwError(f"logging.loggers[{i}]: {spec['class_path']} is not a lightning.pytorch.loggers.Logger "
                          "subclass")
        if "save_dir" in inspect.signature(cls).parameters and "save_dir" not in init_args:
            init_args["save_dir"] = str(_default_save_dir(cls, Path(cfg["run_dir"])))
        try:
            out.append(cls(**init_args))
        except ImportError as e:   # e.g. WandbLogger without wandb installed
            raise FwError(f"logging.loggers[{i}]: {spec['class_path']}: {e}") from e
    return out


def build_loggers(cfg: dict) -> list[Logger]:
    """metrics.jsonl always; CSV and TensorBoard under `<run_dir>/logs/` when enabled; then the user's."""
    run_dir = Path(cfg["run_dir"])
    loggers: list[Logger] = [JsonlLogger(run_dir / "metrics.jsonl", name=cfg["name"])]
    if cfg["logging"]["csv"]:
        loggers.append(CSVLogger(save_dir=run_dir, name="logs", version=None))
    if cfg["logging"]["tensorboard"]:
        loggers.append(TensorBoardLogger(save_dir=run_dir, name="logs", version=None, default_hp_metric=False))
    return loggers + user_loggers(cfg)


def log_config(loggers: list[Logger], cfg: dict) -> None:
    """The resolved config as every logger's hyperparameters (metrics.jsonl: it is config.yaml already)."""
    for logger in loggers:
        logger.log_hyperparams(cfg)
