"""The run's loggers: metrics.jsonl always, CSV and TensorBoard when enabled, and `logging.loggers`.

CSV and TensorBoard share one folder, `<run_dir>/logs/version_0`, which a resume continues: the CSV rows
a crashed run wrote past the checkpoint are dropped as metrics.jsonl's lines are, and TensorBoard's new
event file starts with a purge at the step after the checkpoint, which hides the stale points.

A user logger is any `lightning.pytorch.loggers.Logger` named by `class_path` and built with `init_args`
(W&B, MLflow, Comet, ...). When its class takes a `save_dir` and `init_args` sets none, it writes under
`<run_dir>/logs/<name>` (`WandbLogger` -> `logs/wandb`), with the run's other logs instead of the working
directory. Every logger receives the resolved config as hyperparameters (`log_config`). A FwError that a user
logger's `log_metrics`, `log_graph`, `save` or `finalize` raises names its entry and the method; any other exception
is the logger's bug and keeps its traceback, except in `finalize("failed")`, which Lightning calls while another
exception ends the run: that one is reported in one line and the run's own exception stays the run's.
"""

from __future__ import annotations

import csv
import inspect
import io
import math
import os
import struct
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from framework.durable import replace_file
from framework.errors import FwError
from framework.metrics import JsonlLogger

LOG_DIR = ("logs", 0)   # CSV and TensorBoard: <run_dir>/logs/version_0


def hparams_yaml(hparams: dict[str, Any] | Namespace) -> str:
    """The text Lightning's `save_hparams_to_yaml` writes for `hparams` (a copy: Lightning's writer replaces a value
    it leaves out by its type's name). The writer takes a path, so it writes into fsspec's in-memory file system,
    and `_write_hparams` puts the text on disk in one rename."""
    import uuid

    import fsspec
    from lightning.pytorch.core.saving import save_hparams_to_yaml

    memory = fsspec.filesystem("memory")
    folder = f"/fw-hparams-{uuid.uuid4().hex}"
    memory.makedirs(folder, exist_ok=True)
    try:
        save_hparams_to_yaml(f"memory://{folder}/hparams.yaml", dict(vars(hparams) if isinstance(hparams, Namespace)
                                                                     else hparams))
        return memory.cat_file(f"{folder}/hparams.yaml").decode("utf-8")
    finally:
        memory.rm(folder, recursive=True)


def _write_hparams(log_dir: str, hparams: dict[str, Any] | Namespace) -> None:
    """`<log_dir>/hparams.yaml` as Lightning writes it, rendered first and then replaced in one rename
    (`replace_file`): a crash or a value that cannot be written leaves the previous file."""
    replace_file(Path(log_dir) / "hparams.yaml", hparams_yaml(hparams))


def _csv_step(row: dict[str, str | None]) -> float:
    """A metrics.csv row's step; a row without a readable one counts as past every step."""
    try:
        return float(row.get("step") or "inf")
    except ValueError:
        return math.inf


def earlier_logs(run_dir: str | os.PathLike) -> Path | None:
    """A file in `<run_dir>/logs/version_0` that holds points an earlier run logged (a CSV row, a TensorBoard
    event file), or None. A fresh run would continue it, so it is refused (framework/trainer.py)."""
    folder = Path(run_dir, LOG_DIR[0], f"version_{LOG_DIR[1]}")
    csv_file = folder / ExperimentWriter.NAME_METRICS_FILE
    if csv_file.is_file():
        with open(csv_file, encoding="utf-8", errors="replace") as f:
            if sum(1 for line in f if line.strip()) > 1:   # a header alone holds no point
                return csv_file
    if not folder.is_dir():
        return None
    return next((f for f in sorted(folder.glob("events.out.tfevents.*")) if _holds_events(f)), None)


def _holds_events(event_file: Path) -> bool:
    """Whether a TensorBoard event file holds anything beyond the file-version record its writer opens it with.

    Lightning opens the writer at setup, so a run that fails before it logs leaves a file holding only that
    record, which is no earlier run. A record cut short (a run killed mid-write) counts as a point."""
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event

    data = event_file.read_bytes()
    pos = 0
    while pos < len(data):
        # a TFRecord: the data's length (uint64), its masked CRC (uint32), the data, the data's masked CRC
        if pos + 12 > len(data):
            return True
        (length,) = struct.unpack_from("<Q", data, pos)
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(data):
            return True
        try:
            event = Event.FromString(data[start:end])
        except DecodeError:   # a record no writer finished
            return True
        if event.WhichOneof("what") != "file_version":
            return True
        pos = end + 4
    return False


class _CsvWriter(ExperimentWriter):
    """Lightning's CSV writer, except that it continues an existing metrics.csv (Lightning's deletes it) and
    writes it safely: rows are appended and fsynced; a new column rewrites the file into a temporary one,
    renamed over it."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.metrics_keys = self._read()[0]   # appended rows follow the file's own header

    def _check_log_dir_exists(self) -> None:
        pass   # Lightning's removes metrics.csv; a resumed run continues it

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        _write_hparams(self.log_dir, self.hparams)

    def _read(self) -> tuple[list[str], list[dict[str, str | None]], bool]:
        """The file's header and rows, and whether its last row was cut short (a run killed mid-write; left
        out)."""
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return [], [], False
        with open(path, newline="", encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
        torn = bool(lines) and not lines[-1].endswith(("\n", "\r"))
        reader = csv.DictReader(lines[:-1] if torn else lines)
        rows = list(reader)
        return list(reader.fieldnames or []), rows, torn

    def _replace(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        text = io.StringIO(newline="")
        if keys:   # else no header survived (a first line cut short): an empty file
            writer = csv.DictWriter(text, fieldnames=keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        replace_file(self.metrics_file_path, text.getvalue())
        self.metrics_keys = keys

    def save(self) -> None:
        """Write the rows logged since the last save."""
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        new = set().union(*self.metrics) - set(self.metrics_keys)
        if new or not path.is_file():
            header, rows, _ = self._read()
            self._replace(sorted({*header, *self.metrics_keys, *new}), rows + self.metrics)
        else:
            with open(path, "a", newline="", encoding="utf-8") as f:
                csv.DictWriter(f, fieldnames=self.metrics_keys).writerows(self.metrics)
                f.flush()
                os.fsync(f.fileno())
        self.metrics = []

    def truncate_after(self, step: int) -> None:
        """Drop rows with `step` > `step` (written after the checkpoint a run resumes from), and a torn last row."""
        header, rows, torn = self._read()
        keep = [r for r in rows if _csv_step(r) <= step]
        if torn or len(keep) < len(rows):
            self._replace(header, keep)


class RunCSVLogger(CSVLogger):
    """Lightning's CSVLogger in `<run_dir>/logs/version_0`, continued by a resumed run."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        super().__init__(save_dir=run_dir, name=LOG_DIR[0], version=LOG_DIR[1])

    @property
    @rank_zero_experiment
    def experiment(self) -> _CsvWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _CsvWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def truncate_after(self, step: int) -> None:
        """Drop the rows a resumed run writes again (see `JsonlLogger.truncate_after`)."""
        self.experiment.truncate_after(step)


class RunTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger in `<run_dir>/logs/version_0`, continued by a resumed run.

    The event writer opens at the first metrics, after `truncate_after(step)`, with `purge_step=step + 1`:
    TensorBoard then hides the points past `step` that earlier event files hold. Each writer's file name
    ends in the time in nanoseconds: tensorboardX names a file by the whole second, so a second writer within
    one second would overwrite the first one's file, and files of one second would not sort in the order they
    were written, which the purge needs.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        super().__init__(save_dir=run_dir, name=LOG_DIR[0], version=LOG_DIR[1], default_hp_metric=False)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._kwargs["filename_suffix"] = f".{time.time_ns()}"
        return TensorBoardLogger.experiment.fget(self)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, metrics: dict[str, Any] | None = None,
                        step: int | None = None) -> None:
        super().log_hyperparams(params, metrics, step)
        # Lightning's writes hparams.yaml only where there is none; a resumed run records its own config,
        # as config.yaml does
        os.makedirs(self.log_dir, exist_ok=True)
        _write_hparams(self.log_dir, self.hparams)

    @rank_zero_only
    def save(self) -> None:
        """Flush the event file; opening one here would be before `truncate_after` sets the purge."""
        if self._experiment is not None:
            self._experiment.flush()

    @rank_zero_only
    def truncate_after(self, step: int) -> None:
        """Hide the points a resumed run writes again: the next event file starts with a purge past `step`."""
        self._kwargs["purge_step"] = step + 1
        if self._experiment is not None:   # opened early (a user's callback): the purge needs a new file
            self._experiment.close()
            self._experiment = None


def _default_save_dir(cls: type, run_dir: Path) -> Path:
    name = cls.__name__.removesuffix("Logger").lower() or cls.__name__.lower()
    return run_dir / "logs" / name


def _raised(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


GUARDED = ("log_metrics", "log_graph", "save", "finalize")   # a user logger's methods that fw and Lightning call


class _Guarded:
    """A user logger's `method`, set on the instance in place of its class's: a FwError it raises names the
    `logging.loggers` entry (`where`) and the method; an exception of `finalize("failed")` is one line on stderr
    instead of replacing the exception that ends the run. Picklable with its logger (ddp_spawn pickles the trainer)."""

    def __init__(self, logger: Logger, method: str, where: str) -> None:
        self.logger, self.method, self.where = logger, method, where

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the class's method: the instance's attribute is this object
        call = getattr(type(self.logger), self.method).__get__(self.logger)
        try:
            return call(*args, **kwargs)
        except FwError as e:
            if self._failing(args, kwargs):
                self._say(e)
                return None
            error = FwError(f"{self.where}.{self.method} raised: {e}")
            error.every_rank, error.quiet = e.every_rank, e.quiet
            raise error from e
        except Exception as e:   # user code; an interrupt or exit goes through
            if self._failing(args, kwargs):
                self._say(e)
                return None
            raise

    def _failing(self, args: tuple, kwargs: dict) -> bool:
        """Whether this is Lightning's `finalize("failed")`: the run ends on another exception already."""
        return self.method == "finalize" and (args[0] if args else kwargs.get("status")) == "failed"

    def _say(self, e: Exception) -> None:
        print(f"fw: warning: {self.where}.finalize raised {_raised(e)} while the run ended on an earlier error, "
              "reported below", file=sys.stderr, flush=True)


def user_loggers(cfg: dict) -> list[Logger]:
    """`logging.loggers: [{class_path, init_args}]` instantiated; each must be a Lightning `Logger`. A constructor
    that raises (a missing package, a tracking URI its store cannot serve, ...) is an FwError naming the entry,
    its class and the exception: a config problem, one line. The methods of `GUARDED` are guarded (`_Guarded`)."""
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
            logger = cls(**init_args)
        except Exception as e:   # user code; an interrupt or exit goes through
            raise FwError(f"logging.loggers[{i}]: building {spec['class_path']} raised {_raised(e)}") from e
        for method in GUARDED:
            setattr(logger, method, _Guarded(logger, method, f"logging.loggers[{i}]: {spec['class_path']}"))
        out.append(logger)
    return out


def build_loggers(cfg: dict) -> list[Logger]:
    """metrics.jsonl always; CSV and TensorBoard in `<run_dir>/logs/version_0` when enabled; then the user's."""
    run_dir = Path(cfg["run_dir"])
    loggers: list[Logger] = [JsonlLogger(run_dir / "metrics.jsonl", name=cfg["name"])]
    if cfg["logging"]["csv"]:
        loggers.append(RunCSVLogger(run_dir))
    if cfg["logging"]["tensorboard"]:
        loggers.append(RunTensorBoardLogger(run_dir))
    return loggers + user_loggers(cfg)


def log_config(loggers: list[Logger], cfg: dict) -> None:
    """The resolved config as every logger's hyperparameters (metrics.jsonl: it is config.yaml already). `loggers`
    are `build_loggers(cfg)`'s, the user's last. This is fw's first use of a user logger, where most open their run
    (an MLflow or W&B client): an exception there is an FwError naming the `logging.loggers` entry, its class and
    the exception."""
    specs = cfg["logging"]["loggers"]
    first_user = len(loggers) - len(specs)
    for k, logger in enumerate(loggers):
        if k < first_user:
            logger.log_hyperparams(cfg)
            continue
        i = k - first_user
        try:
            logger.log_hyperparams(cfg)
        except Exception as e:   # user code; an interrupt or exit goes through
            raise FwError(f"logging.loggers[{i}]: {specs[i]['class_path']} raised {_raised(e)} when given the run's "
                          "config (its first use, log_hyperparams)") from e
