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

import contextlib
import csv
import inspect
import io
import logging
import math
import numbers
import os
import queue
import re
import struct
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from framework.console import say
from framework.durable import disk_full, disk_full_cause, replace_file
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
    record, which is no earlier run. A record cut short (a run killed mid-write) counts as a point. The file is read
    as TFRecords, with no protobuf decoder: Lightning writes with torch's writer where the tensorboard package is
    installed, else with tensorboardX's, and tensorboardX's may then be missing (an install without fw's own
    dependencies). The first record counts as the file-version one when its event holds the version string as
    the event's file_version field (`_FILE_VERSION`)."""
    with open(event_file, "rb") as f:   # the first record and the file's size: a long run's file is not read
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return False
        # a TFRecord: the data's length (uint64), its masked CRC (uint32), the data, the data's masked CRC
        head = f.read(12)
        if len(head) < 12:
            return True
        (length,) = struct.unpack_from("<Q", head)
        end = 12 + length + 4
        if end > size or not _FILE_VERSION.search(f.read(length)):
            return True
    return end < size


# An Event's file_version (field 3, a string: tag byte 0x1a, then its length) holding "brain.Event:<n>", as a writer's
# first event does; the same text as a scalar's tag sits behind another field's tag.
_FILE_VERSION = re.compile(rb"\x1a.brain\.Event:", re.DOTALL)


@contextlib.contextmanager
def _full_disk_stops(key: str, path: Callable[[], str | os.PathLike], what: str) -> Iterator[None]:
    """A write that finds no room (ENOSPC / EDQUOT / EFBIG anywhere in an exception's chain: Lightning wraps some in
    a ValueError) as `disk_full`'s one-line error naming `key` and the file `path()`, the OSError kept as its
    cause."""
    try:
        yield
    except FwError:
        raise
    except Exception as e:
        cause = disk_full_cause(e)
        if cause is None:
            raise
        raise disk_full(path(), what, key, cause=cause) from cause


def _finalize_failed(finalize: Callable[[], None]) -> None:
    """A logger's `finalize("failed")`, which Lightning calls while another exception ends the run: a full disk
    there is left to that exception (often the same full disk), so that the run still ends on its one line. What
    it loses was logged past the newest checkpoint, which a resume writes again."""
    try:
        finalize()
    except Exception as e:
        if disk_full_cause(e) is None:
            raise


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
            text = f.read()
        # rows end in CR or LF only: str.splitlines would also split a metric name at a form feed or U+2028,
        # which the csv module writes unquoted
        torn = bool(text) and not text.endswith(("\n", "\r"))
        if torn:
            text = text[:max(text.rfind("\n"), text.rfind("\r")) + 1]
        reader = csv.DictReader(io.StringIO(text, newline=""))
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

    def _full_disk_stops(self) -> contextlib.AbstractContextManager[None]:
        return _full_disk_stops("logging.csv", lambda: self.experiment.metrics_file_path, "the CSV metrics")

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace) -> None:
        with _full_disk_stops("logging.csv", lambda: Path(self.log_dir) / "hparams.yaml", "the run's config"):
            super().log_hyperparams(params)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        with self._full_disk_stops():   # Lightning's saves every flush_logs_every_n_steps
            super().log_metrics(metrics, step)

    @rank_zero_only
    def save(self) -> None:
        with self._full_disk_stops():
            super().save()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status == "failed":
            _finalize_failed(lambda: self.save() if self._experiment is not None else None)
            return
        super().finalize(status)

    @rank_zero_only
    def truncate_after(self, step: int) -> None:
        """Drop the rows a resumed run writes again (see `JsonlLogger.truncate_after`)."""
        self.experiment.truncate_after(step)


_PUT_WAIT_S = 0.5   # how long a queued event waits for room before the writer thread is looked at again


class _EventWriterGuard:
    """Keeps tensorboardX's event writer from hanging the run when its file cannot be written.

    tensorboardX queues each event (a bounded queue) for a thread that writes the file. An OSError there (a full
    disk) would end that thread, and the next event queued once the queue is full would wait for it forever. So
    the record writer's `write_event`, `flush` and `close` are wrapped on the instance: the first OSError is kept
    and every later write dropped, the thread living on to drain the queue; and `add_event` queues with a timeout,
    looking at the kept error and at the thread between tries, so `check()` raises in the caller. Neither
    tensorboardX nor Lightning offers a public way to learn of that thread's end, so the guard reads the writer's
    private attributes; a tensorboardX whose writer lacks one is left unguarded, `missing` naming what it lacks.
    Writers of another layout (torch.utils.tensorboard, whose own thread hands its error to the caller) are left as
    they are. Either way `active` is False."""

    EVENTS = ("_event_queue", "_worker", "_closed", "_ev_writer")   # the EventFileWriter's attributes it reads
    RECORDS = ("write_event", "flush", "close")   # the EventsWriter's methods it wraps

    def __init__(self, experiment: Any) -> None:
        self.failure: OSError | None = None
        self.file: str | None = None   # the event file, where the layout names it
        self.abandoned = False   # closed by `abandon`: the thread had ended, what it had not written is lost
        self.file_writer = getattr(experiment, "file_writer", None)
        self.events = getattr(self.file_writer, "event_writer", None)   # tensorboardX's EventFileWriter
        self.records = getattr(self.events, "_ev_writer", None)   # its EventsWriter, which the thread writes with
        self.missing = self._missing(experiment)   # None: not tensorboardX's writer
        self.active = self.missing == []
        if not self.active:
            return
        self.file = getattr(self.records, "_file_name", None)
        for method in ("write_event", "flush"):
            setattr(self.records, method, self._kept(getattr(self.records, method)))
        close = self.records.close

        def close_file() -> None:
            try:   # the file is closed even where its last flush fails
                close()
            except OSError as e:
                self.failure = self.failure or e

        self.records.close = close_file
        self.events.add_event = self._add_event

    def _missing(self, experiment: Any) -> list[str] | None:
        """What tensorboardX's writer `experiment` lacks of what the guard reads, or None for another writer."""
        tensorboardx = sys.modules.get("tensorboardX")   # loaded wherever the writer is a tensorboardX one
        if tensorboardx is None or not isinstance(experiment, tensorboardx.SummaryWriter):
            return None
        if self.events is None:
            return ["SummaryWriter.file_writer.event_writer"]
        missing = [f"EventFileWriter.{a}" for a in self.EVENTS if not hasattr(self.events, a)]
        if missing:
            return missing
        needed = {"EventFileWriter.add_event": getattr(self.events, "add_event", None),
                  "EventFileWriter._event_queue.put": getattr(self.events._event_queue, "put", None),
                  "EventFileWriter._worker.is_alive": getattr(self.events._worker, "is_alive", None),
                  **{f"EventsWriter.{m}": getattr(self.records, m, None) for m in self.RECORDS}}
        return [name for name, method in needed.items() if not callable(method)]

    def unguarded(self) -> str:
        """The warning for a tensorboardX writer that lacks what the guard reads (`missing`)."""
        version = getattr(sys.modules.get("tensorboardX"), "__version__", "(version unknown)")
        return (f"fw: warning: logging.tensorboard: tensorboardX {version}'s event writer has no "
                f"{', '.join(self.missing or [])}, which fw reads to stop the run when the event file cannot be "
                "written (a full disk); without it such a run may wait forever instead. With tensorboard installed, "
                "Lightning writes through torch.utils.tensorboard, which reports that error itself")

    def _kept(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.failure is not None:   # past a failed write the file holds a torn record: nothing more
                return None
            try:
                return method(*args, **kwargs)
            except OSError as e:
                self.failure = e
                return None
        return call

    def _add_event(self, event: Any) -> None:
        """tensorboardX's `EventFileWriter.add_event`, whose put waits for room a while at a time."""
        while not self.events._closed:
            self.check()
            try:
                self.events._event_queue.put(event, timeout=_PUT_WAIT_S)
                return
            except queue.Full:
                continue

    def thread_gone(self) -> bool:
        """Whether the writer thread has ended while its writer was open (an exception other than an OSError)."""
        if self.abandoned:
            return True
        worker = getattr(self.events, "_worker", None)
        return self.active and not self.events._closed and worker is not None and not worker.is_alive()

    def check(self) -> None:
        """Raise the kept write error as a one-line error naming `logging.tensorboard` and the file."""
        file = self.file or getattr(self.events, "get_logdir", lambda: "the TensorBoard log")()
        if self.failure is not None:
            if disk_full_cause(self.failure) is not None:
                raise disk_full(file, "TensorBoard's events", "logging.tensorboard",
                                cause=self.failure) from self.failure
            raise FwError(f"logging.tensorboard: {file}: writing TensorBoard's events failed: {self.failure}; the run "
                          "stopped, its published checkpoints are intact") from self.failure
        if self.thread_gone():
            raise FwError(f"logging.tensorboard: the thread writing {file} has ended (its error is above); the run "
                          "stopped, its published checkpoints are intact")

    def abandon(self) -> None:
        """Close a writer whose thread has ended without the thread: tensorboardX's close would queue a stop for it
        and wait for its end, forever once the queue is full."""
        if self.abandoned:
            return
        self.abandoned = True
        self.events._closed = True
        with contextlib.suppress(Exception):
            self.events._event_queue.cancel_join_thread()   # nothing reads the queue at exit
        self.records.close()


class _NoAnonymousNonFinite(logging.Filter):
    """Drops tensorboardX's `NaN or Inf found in input tensor.`, which it logs for every non-finite scalar without
    naming it; `RunTensorBoardLogger.log_metrics` names the metric instead, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("NaN or Inf found")


_NAN_CHECK = logging.getLogger("tensorboardX.x2num")   # the logger of tensorboardX's check


@contextlib.contextmanager
def _no_anonymous_non_finite() -> Iterator[None]:
    quiet = _NoAnonymousNonFinite()
    _NAN_CHECK.addFilter(quiet)
    try:
        yield
    finally:
        _NAN_CHECK.removeFilter(quiet)


# The module of torch.utils.tensorboard's writer thread (the tensorboard package's). An error there ends the thread,
# which keeps the exception for the writer to raise in the caller at its next write or flush and then re-raises it
# itself, and threading prints that again with its traceback, on top of fw's one line.
_TORCH_WRITER_THREADS = "tensorboard.summary.writer.event_file_writer"


@contextlib.contextmanager
def quiet_event_writer_threads() -> Iterator[None]:
    """For a fit's duration: the error that ends torch.utils.tensorboard's writer thread is left to the writer's
    caller (fw's one line naming `logging.tensorboard`), not printed with its traceback; any other thread's uncaught
    error reaches the hook that was there before, which comes back at the end (unless something set another)."""
    before = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__ != _TORCH_WRITER_THREADS:
            before(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        if threading.excepthook is hook:
            threading.excepthook = before


def _after_the_second_of(folder: Path) -> None:
    """Wait, where `folder` holds an event file opened in the current second, until the next one.

    TensorBoard reads a folder's event files in name order, and both writers begin a file's name with the second
    it is opened in. tensorboardX's name then ends in the suffix fw gives (the time in ns), which orders files of
    one second; torch.utils.tensorboard's (used where the tensorboard package is installed) has the process id
    and a counter before it, so a resume's file of that second could sort before the earlier run's and its points
    show first. The wait is bounded by the monotonic clock, whatever the wall clock does."""
    deadline = time.monotonic() + 1.05
    while any(folder.glob(f"events.out.tfevents.{int(time.time()):010d}.*")) and time.monotonic() < deadline:
        time.sleep(0.01)


class RunTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger in `<run_dir>/logs/version_0`, continued by a resumed run.

    The event writer opens at the first metrics, after `truncate_after(step)`, with `purge_step=step + 1`:
    TensorBoard then hides the points past `step` that earlier event files hold. Each writer's file name
    ends in the time in nanoseconds: tensorboardX names a file by the whole second, so a second writer within
    one second would overwrite the first one's file, and files of one second would not sort in the order they
    were written, which the purge needs.

    A file that cannot be written (a full disk) stops the run with one line naming `logging.tensorboard` and the
    event file, at the next metrics, save or finalize, instead of leaving it waiting for a writer thread that has
    ended (`_EventWriterGuard`).

    An infinite or NaN value (a user's metric, fp16's grad_norm on a step its loss scaler skipped) is written as it
    is, which TensorBoard's events hold; the first one of each metric is named in one line on stderr, in place of
    tensorboardX's warning for each such value, which names none. fw's lines are written above Lightning's progress
    bar (`framework.console.say`).
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        super().__init__(save_dir=run_dir, name=LOG_DIR[0], version=LOG_DIR[1], default_hp_metric=False)
        self._guard: _EventWriterGuard | None = None
        self._non_finite: set[str] = set()   # the metrics named on stderr for a non-finite value
        self._said_unguarded = False   # the warning of a tensorboardX writer the guard cannot read

    def __getstate__(self) -> dict[str, Any]:
        # Lightning's drops the open writer when a logger is pickled; its guard holds the writer's queue
        state = super().__getstate__()
        state["_guard"] = None
        return state

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            _after_the_second_of(Path(self.log_dir))
            self._kwargs["filename_suffix"] = f".{time.time_ns()}"
        experiment = TensorBoardLogger.experiment.fget(self)
        guard = getattr(self, "_guard", None)
        if guard is None or guard.file_writer is not getattr(experiment, "file_writer", None):
            self._guard = guard = _EventWriterGuard(experiment)
            if guard.missing and not getattr(self, "_said_unguarded", False):
                self._said_unguarded = True
                say(guard.unguarded(), flush=True)
        return experiment

    def _event_file(self) -> str:
        """The writer's event file, for the line of a failed write: the one the guard read, else the one whose name
        ends in this writer's suffix (torch.utils.tensorboard's writer), else the folder."""
        guard = getattr(self, "_guard", None)
        if guard is not None and guard.file:
            return guard.file
        named = self._own_event_files()
        return str(named[-1]) if named else self.log_dir

    def _own_event_files(self) -> list[Path]:
        """The event files of this logger's writers: those whose names end in the suffix fw gives them."""
        suffix = self._kwargs.get("filename_suffix")
        return sorted(Path(self.log_dir).glob(f"events.out.tfevents.*{suffix}")) if suffix else []

    @contextlib.contextmanager
    def _checked(self) -> Iterator[None]:
        """Run a call on the writer, then raise its write error (`_EventWriterGuard.check`); a full disk met in
        the call itself (another writer's layout) is the same one-line error."""
        try:
            with _full_disk_stops("logging.tensorboard", self._event_file, "TensorBoard's events"):
                yield
        except Exception:
            if self._guard is not None:   # the kept error says more than Lightning's ValueError around it
                self._guard.check()
            raise
        if self._guard is not None:
            self._guard.check()

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            value = value.item() if isinstance(value, Tensor) and value.numel() == 1 else value
            if isinstance(value, numbers.Real) and not math.isfinite(value) and key not in self._non_finite:
                self._non_finite.add(key)
                say(f"fw: warning: metric {key!r} is {value} at step {step}; TensorBoard records it as logged "
                    "(said once per metric)", flush=True)
        with self._checked(), _no_anonymous_non_finite():
            super().log_metrics(metrics, step)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, metrics: dict[str, Any] | None = None,
                        step: int | None = None) -> None:
        with self._checked():
            super().log_hyperparams(params, metrics, step)
        # Lightning's writes hparams.yaml only where there is none; a resumed run records its own config,
        # as config.yaml does
        os.makedirs(self.log_dir, exist_ok=True)
        with _full_disk_stops("logging.tensorboard", lambda: Path(self.log_dir) / "hparams.yaml", "the run's config"):
            _write_hparams(self.log_dir, self.hparams)

    @rank_zero_only
    def save(self) -> None:
        """Flush the event file; opening one here would be before `truncate_after` sets the purge."""
        if self._experiment is not None:
            with self._checked():
                self._experiment.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._guard is not None and self._guard.thread_gone():
            self._guard.abandon()
        if status == "failed":
            _finalize_failed(lambda: super(RunTensorBoardLogger, self).finalize(status))
            return
        with self._checked():
            super().finalize(status)

    @rank_zero_only
    def truncate_after(self, step: int) -> None:
        """Hide the points a resumed run writes again: the next event file starts with a purge past `step`."""
        self._kwargs["purge_step"] = step + 1
        if self._experiment is None:
            return
        # opened early (Lightning's setup opens it at every start; a user's callback may write to it): the purge needs
        # a new file. The closed writer's file, the one whose name ends in its suffix (`experiment`), goes when it
        # holds nothing past its file-version record: else every start, each resume's too, would leave one behind.
        self._experiment.close()
        self._experiment = None
        for f in self._own_event_files():
            if not _holds_events(f):
                f.unlink(missing_ok=True)


def _default_save_dir(cls: type, run_dir: Path) -> Path:
    name = cls.__name__.removesuffix("Logger").lower() or cls.__name__.lower()
    return run_dir / "logs" / name


def _raised(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


GUARDED = ("log_metrics", "log_graph", "save", "finalize")   # a user logger's methods that fw and Lightning call


class _Guarded:
    """A user logger's `method`, set on the instance in place of its class's: a FwError it raises names the
    `logging.loggers` entry (`where`) and the method; an exception of `finalize("failed")` is one line on stderr
    instead of replacing the exception that ends the run. Picklable with its logger, as Lightning's loggers are."""

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
        say(f"fw: warning: {self.where}.finalize raised {_raised(e)} while the run ended on an earlier error, "
            "reported below", flush=True)


def logger_class_problem(class_path: str) -> str | None:
    """Why the class `class_path` names cannot serve in `logging.loggers` (not a Lightning `Logger`, or abstract),
    or None; checked before anything is built, as a logger's constructor may create runs and directories."""
    from framework.imports import import_object

    cls = import_object(class_path)
    if not (isinstance(cls, type) and issubclass(cls, Logger)):
        return f"{class_path} is not a lightning.pytorch.loggers.Logger subclass"
    if inspect.isabstract(cls):
        return f"{class_path} is abstract: it does not implement {', '.join(sorted(cls.__abstractmethods__))}"
    return None


def _init_args(cls: type, spec: dict, run_dir: Path) -> dict:
    """`spec`'s init_args, with `save_dir` under `run_dir` where the class takes one and they set none."""
    init_args = dict(spec.get("init_args") or {})
    if "save_dir" in inspect.signature(cls).parameters and "save_dir" not in init_args:
        init_args["save_dir"] = str(_default_save_dir(cls, run_dir))
    return init_args


def logger_args_problem(spec: dict, run_dir: str | Path) -> str | None:
    """Why the class of a `logging.loggers` entry cannot be called with its init_args (and the `save_dir` fw gives):
    a required argument missing, which `fw validate` names without building the logger; or None."""
    from framework.imports import import_object

    cls = import_object(spec["class_path"])
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):   # no signature to read: the constructor decides
        return None
    try:
        sig.bind(**_init_args(cls, spec, Path(run_dir)))
    except TypeError as e:
        return f"init_args do not fit {spec['class_path']}{sig}: {e}"
    return None


def user_loggers(cfg: dict) -> list[Logger]:
    """`logging.loggers: [{class_path, init_args}]` instantiated; each must be a Lightning `Logger`. A constructor
    that raises (a missing package, a tracking URI its store cannot serve, ...) is an FwError naming the entry,
    its class and the exception: a config problem, one line. The methods of `GUARDED` are guarded (`_Guarded`)."""
    from framework.imports import import_object, user_line

    out = []
    for i, spec in enumerate(cfg["logging"]["loggers"]):
        problem = logger_class_problem(spec["class_path"])
        if problem is not None:
            raise FwError(f"logging.loggers[{i}]: {problem}")
        cls = import_object(spec["class_path"])
        init_args = _init_args(cls, spec, Path(cfg["run_dir"]))
        try:
            logger = cls(**init_args)
        except Exception as e:   # user code; an interrupt or exit goes through
            raise FwError(f"logging.loggers[{i}]: building {spec['class_path']} raised {_raised(e)}"
                          f"{user_line(e)}") from e
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
