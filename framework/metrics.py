"""Per-step metrics: torchmetrics aggregation over micro-batches and ranks, and the metrics.jsonl logger.

Recipes record values with `ctx.log` (`FwModule.log_fw_metric`), user code with `FwModule.log_metric(name, value,
weight, reduce)`, which refuses fw's names; they accumulate in
`StepMetrics` until a logged optimizer step, where `compute()` reduces them across ranks (so a
token-weighted loss is the exact token mean of the global batch, accumulation included).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from framework.durable import disk_full, disk_full_cause, replace_file
from framework.errors import FwError
from framework.jsonl import decode_utf8, json_type_name


class _Float64:
    """A torchmetrics aggregator whose states are float64 whatever the dtypes around it, and whose update casts
    without looking for NaN (torchmetrics' check waits for the device at every update; StepMetrics.compute looks
    at the reduced values instead)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # torchmetrics makes its states in torch's default dtype, which the -true precisions set to a 16-bit type
        # inside training_step, where metrics are first logged: a bfloat16 mean keeps three significant digits and
        # a bfloat16 sum stops growing at 256
        for key, default in self._defaults.items():
            self._defaults[key] = default.to(torch.float64)
            setattr(self, key, getattr(self, key).to(torch.float64))
        self._dtype = torch.float64

    def _apply(self, fn: Any, exclude_state: Sequence[str] = ()) -> _Float64:
        # device moves only: the -true precisions convert the module, with the metrics a checkpoint restored, to
        # their 16-bit dtype
        device = fn(torch.zeros((), dtype=torch.float64, device=self.device)).device
        for key, default in self._defaults.items():
            self._defaults[key] = default.to(device)
            setattr(self, key, getattr(self, key).to(device))
        self._device = device
        self._computed = None
        return self

    def _cast_and_nan_check_input(self, x: torch.Tensor | float,
                                  weight: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.as_tensor(x, dtype=torch.float64, device=self.device)
        w = torch.ones_like(x) if weight is None else torch.as_tensor(weight, dtype=torch.float64, device=self.device)
        return x, w


class _Mean(_Float64, torchmetrics.MeanMetric):
    def compute(self) -> torch.Tensor:
        # torchmetrics calls this with the states summed over ranks: their total weight is kept beside the mean,
        # since a mean of no weight (0 / 0) is no value and StepMetrics leaves it out of the record
        self.total_weight = self.weight.clone()
        return self.mean_value / self.weight


class _Sum(_Float64, torchmetrics.SumMetric):
    pass


class _Max(_Float64, torchmetrics.MaxMetric):
    pass


class _Min(_Float64, torchmetrics.MinMetric):
    pass


REDUCTIONS = {"mean": _Mean, "sum": _Sum, "max": _Max, "min": _Min}


def on_device(x: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """`x` as a float64 tensor on `device`. A Python number is filled in by a kernel: a tensor made from it
    on the host and copied would make the host wait for the work queued on the GPU."""
    if isinstance(x, torch.Tensor):
        return torch.as_tensor(x.detach(), dtype=torch.float64, device=device)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def read_scalars(tensors: Sequence[torch.Tensor]) -> list[float]:
    """The values of one-element tensors as floats, in order, with one transfer per device they live on."""
    out: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        values = torch.stack([tensors[i].detach().reshape(()).to(torch.float64) for i in indices]).tolist()
        for i, v in zip(indices, values, strict=True):
            out[i] = v
    return out


RESERVED_NAMES = ("step",)   # keys a metrics.jsonl record sets itself
# What fw writes into a record besides what it logs through StepMetrics: FwModule.flush_metrics's values (its
# memory figures under memory/), and the evaluation's, which it writes only at its steps (under EVAL_PREFIX,
# framework/evaluation.py)
FW_RECORD_NAMES = ("tokens_per_s",)
FW_PREFIXES = ("eval/", "memory/")


def fw_writes(name: str) -> bool:
    """Whether fw writes `name` into metrics.jsonl whatever it logs through StepMetrics."""
    return name in FW_RECORD_NAMES or name.startswith(FW_PREFIXES)


def _check_user_value(name: str, value: Any) -> None:
    """An error naming the metric unless `value` is one real number, a Python number or a one-element tensor of a
    real dtype: TypeError for another type, ValueError for a longer tensor (which would be reduced element by
    element, as if logged once for each) or a complex one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"log_metric({name!r}): one value a call, got a tensor of shape {tuple(value.shape)}; "
                             f"log its mean (value.mean()) or each element under a name of its own")
        if value.is_complex():
            raise ValueError(f"log_metric({name!r}): expected a real number, got a {value.dtype} tensor")
        return
    if not isinstance(value, numbers.Real):
        raise TypeError(f"log_metric({name!r}): expected a number or a one-element tensor, got "
                        f"{type(value).__name__} {value!r:.60}")


class StepMetrics(nn.Module):
    """Named torchmetrics aggregators, created on first use; `compute()` returns floats and resets.

    `reduce="last"` keeps the latest value without any reduction (for values equal on every rank, e.g. lr).
    A name belongs to whoever logs it first in the run, fw (`update`) or user code (`update(user=True)`,
    `FwModule.log_metric`); the other's value would be merged into it, so its `update` is refused: user code's with a
    ValueError (and of any name `fw_writes`), fw's with an FwError naming the user's first call.
    A mean whose weights sum to 0 over the interval and the ranks is left out of `compute()`'s result.
    A NaN value logged stops the run with an FwError naming the metric at the next `compute()` (a NaN loss or
    gradient norm means the run has diverged); infinities pass (an fp16 step skipped by loss scaling has an
    infinite grad norm). `update` never waits for the GPU: values stay on the device until `compute()`, the
    logging step, which reads them all in one transfer (the loss and gradients themselves are checked every
    step by callbacks.StopOnNonFinite, whose values `read_ahead` reads in the same transfer).
    """

    def __init__(self) -> None:
        super().__init__()
        # Moves with the module (`.to(device)`): metrics created later live on the same device, which
        # NCCL needs to reduce them (a metric made from a Python float would otherwise stay on the CPU).
        self.register_buffer("_anchor", torch.empty(0), persistent=False)
        self.metrics = nn.ModuleDict()
        self.reductions: dict[str, str] = {}
        self.names: dict[str, str] = {}   # key -> the name it was logged under
        self.last: dict[str, torch.Tensor | float] = {}
        self.last_names: set[str] = set()   # names logged with reduce="last" in this run, kept across compute()
        self.nan_seen: dict[str, torch.Tensor] = {}   # per metric: a NaN value was logged (on the device)
        self._ahead: tuple[list[float], list[float]] | None = None   # read_ahead's (NaN flags, values)
        # name -> whether user code logged it first in this run; kept across compute(), unlike the values
        self.by_user: dict[str, bool] = {}
        self.user_sites: dict[str, str] = {}   # name -> where user code logged it first, for fw's refusal

    def update(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0,
               reduce: str = "mean", user: bool = False, site: str | None = None) -> None:
        """Add a value of `name` to the interval: fw's own (`user=False`), or user code's (`FwModule.log_metric`,
        `site` the FILE:LINE of its call). fw's value of a name user code logged first is refused with an FwError:
        the fault is the user code's, which a traceback of fw's call would not show."""
        self._ahead = None   # a value read ahead no longer holds the interval
        if not isinstance(name, str) or not name or name in RESERVED_NAMES:
            raise ValueError(f"log_metric({name!r}): a metric needs a non-empty name other than "
                             f"{', '.join(map(repr, RESERVED_NAMES))} (the key of each metrics.jsonl record's step)")
        if user:
            _check_user_value(name, value)
        if user and (fw_writes(name) or self.by_user.get(name) is False):
            raise ValueError(f"log_metric({name!r}): fw writes {name!r} itself, and a value logged under its name "
                             f"would be merged into fw's; log yours under a name of its own, e.g. 'user/{name}'")
        if not user and self.by_user.get(name):
            where = f" at {self.user_sites[name]}" if name in self.user_sites else ""
            raise FwError(f"metrics: fw writes {name!r} itself, and user code logged it earlier in the run "
                          f"(module.log_metric{where}), so the two values would be merged; log yours under a "
                          f"name of its own, e.g. 'user/{name}'")
        if reduce != "last" and reduce not in REDUCTIONS:
            raise ValueError(f"log_metric({name!r}): reduce must be 'last' or one of {sorted(REDUCTIONS)}, "
                             f"got {reduce!r}")
        key = self._key(name)
        # a name has one reduction: a 'last' value and an aggregated one would be written under one name, the
        # 'last' one replacing the other
        before = "last" if name in self.last_names else self.reductions.get(key) if self.names.get(key) == name \
            else None
        if before is not None and before != reduce:
            raise ValueError(f"log_metric({name!r}): logged with reduce={before!r} before, now {reduce!r}")
        if reduce == "last":
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(f"log_metric({name!r}): reduce='last' takes one value, got a tensor of shape "
                                 f"{tuple(value.shape)}")
            self._first(name, user, site)
            self.last_names.add(name)
            self.last[name] = value.detach().clone() if isinstance(value, torch.Tensor) else float(value)
            return
        if self.names.setdefault(key, name) != name:
            raise ValueError(f"log_metric({name!r}): {self.names[key]!r} is logged too, and the two cannot be told "
                             f"apart (both are stored as {key!r}: '.' as '__'); rename one of them")
        if key not in self.metrics:
            self.metrics[key] = REDUCTIONS[reduce](nan_strategy="error").to(self._anchor.device)
            self.reductions[key] = reduce
        self._first(name, user, site)
        metric = self.metrics[key]
        value = on_device(value, metric.device)
        seen = torch.isnan(value).any()
        self.nan_seen[name] = seen if name not in self.nan_seen else self.nan_seen[name] | seen
        if reduce == "mean":
            metric.update(value, on_device(weight, metric.device))
        else:
            metric.update(value)

    def _key(self, name: str) -> str:
        """The aggregator's key in `metrics` for `name`: a ModuleDict key holds no '.', and is no attribute of the
        ModuleDict ('values', 'update', 'training', ...), which torch refuses."""
        key = name.replace(".", "__")
        return f"{key}#" if hasattr(nn.ModuleDict, key) or key in vars(self.metrics) else key

    def _pending(self) -> tuple[list[str], list[str], list[str]]:
        """The names of the NaN flags, the keys of the metrics updated, the names of the tensor `last` values."""
        return (list(self.nan_seen), [k for k, m in self.metrics.items() if m.update_count],
                [n for n, v in self.last.items() if isinstance(v, torch.Tensor)])

    def _read(self, extra: Sequence[torch.Tensor]) -> tuple[list[float], tuple[list[float], list[float]]]:
        """`extra`'s values and (NaN flags, values of the metrics and tensor `last` values), in one read."""
        names, keys, last = self._pending()
        flags = [self.nan_seen[n] for n in names]
        if flags and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # a NaN on one rank stops every rank at the same step, not only the one that logged it
            stacked = torch.stack([f.to(self._anchor.device, torch.float32) for f in flags])
            torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX)
            flags = list(stacked)
        means = [self.metrics[k].compute() for k in keys]
        weights = [self.metrics[k].total_weight for k in keys if self.reductions[k] == "mean"]
        tensors = [*extra, *flags, *means, *(self.last[n] for n in last), *weights]
        values = read_scalars(tensors)
        n = len(extra)
        return values[:n], (values[n:n + len(names)], values[n + len(names):])

    def read_ahead(self, extra: Sequence[torch.Tensor]) -> list[float]:
        """The values of the one-element tensors `extra`, read in the same transfer as the interval's metrics
        (collective under DDP: call on all ranks). The next `compute()` takes those without reading again,
        unless a value is logged in between."""
        values, self._ahead = self._read(extra)
        return values

    def _first(self, name: str, user: bool, site: str | None) -> None:
        """Record who logged `name` first in the run (and where, for user code)."""
        if name not in self.by_user:
            self.by_user[name] = user
            if user and site is not None:
                self.user_sites[name] = site

    def compute(self) -> dict[str, float]:
        """Every metric updated since the last call, reduced over ranks (collective: call on all ranks), read
        from the device in one transfer."""
        names, keys, last = self._pending()
        flags, values = self._ahead if self._ahead is not None else self._read(())[1]
        self._ahead = None
        self.nan_seen = {}
        for name, nan in zip(names, flags, strict=True):
            if nan and self.by_user.get(name):   # user code's value: what fw trains may be fine
                where = f" at {self.user_sites[name]}" if name in self.user_sites else ""
                raise _on_every_rank(FwError(f"metric {name!r} is NaN, a value user code logged "
                                             f"(module.log_metric{where}); log finite values only"))
            if nan:
                raise _on_every_rank(FwError(f"metric {name!r} is NaN: the run has diverged (lower optimizer.lr, "
                                             "keep optimizer.max_grad_norm set, or use bf16 instead of fp16)"))
        weights = iter(values[len(keys) + len(last):])
        # a mean whose weights summed to 0 over the interval and the ranks (no loss token in it) is left out
        out = {self.names[k]: v for k, v in zip(keys, values[:len(keys)], strict=True)
               if self.reductions[k] != "mean" or next(weights) != 0}
        for metric in self.metrics.values():
            metric.reset()
        read_last = dict(zip(last, values[len(keys):len(keys) + len(last)], strict=True))
        out.update({name: read_last[name] if name in read_last else float(v) for name, v in self.last.items()})
        self.last = {}
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue a logging interval that a save interrupted.

        The accumulated values are reduced over ranks (a collective under DDP: call on every rank), so
        the state is that of the whole interval so far, independent of the number of processes.
        """
        metrics = {}
        for key, m in self.metrics.items():
            if not m.update_count:
                continue
            with m.sync_context(should_sync=True, should_unsync=True):
                values = {k: v.detach().cpu().clone() for k, v in m.metric_state.items()}
            metrics[key] = {"reduce": self.reductions[key], "update_count": m.update_count, "state": values,
                            "name": self.names[key]}
        return {"metrics": metrics, "last": {name: float(v) for name, v in self.last.items()}}

    def load_state(self, state: dict[str, Any], holder: bool = True) -> None:
        """Continue an interval from `state()`. Exactly one rank (`holder`, rank 0) takes the accumulated
        values; the others start empty but with the same update counts, so every rank reduces the same
        metrics and the next `compute()` adds each value once, whatever the number of processes."""
        self._ahead = None
        self.last = dict(state["last"])
        self.last_names.update(self.last)
        for key, saved in state["metrics"].items():
            if key not in self.metrics:
                self.metrics[key] = REDUCTIONS[saved["reduce"]](nan_strategy="error").to(self._anchor.device)
                self.reductions[key] = saved["reduce"]
            # checkpoints written before the name was kept: a name without '__' reads back from its key
            self.names[key] = saved.get("name", key.replace("__", "."))
            metric = self.metrics[key]
            metric.reset()
            if holder:
                for k, v in saved["state"].items():   # float64 also for a state saved in another dtype
                    setattr(metric, k, v.to(metric.device, metric.dtype))
            metric._update_count = saved["update_count"]


def _on_every_rank(error: FwError) -> FwError:
    """`error`, which every rank of a multi-process job raises together (the NaN flags are reduced over the ranks,
    so none of them is where it arose): global rank 0 reports it alone, naming no rank."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        error.every_rank = True
        error.quiet = dist.get_rank() != 0
    return error


class JsonlLogger(Logger):
    """`<run_dir>/metrics.jsonl`: one JSON object per `log_metrics` call with its `step`.

    `save()` flushes and fsyncs, so lines up to a published checkpoint survive a crash;
    `truncate_after(step)` drops lines a resumed run will write again. `name` is the run's (the config's `name`).
    """

    def __init__(self, path: str | os.PathLike, name: str):
        super().__init__()
        self.path = Path(path)
        self._name = name
        self._file = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """The resolved config is in `<run_dir>/config.yaml`; nothing to add here."""

    def _open(self):
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open across calls; closed in finalize)
        return self._file

    def _full(self, cause: OSError) -> Exception:
        """The one-line DiskFull of a write to the file that found no room (the caller keeps `cause` as its
        cause)."""
        return disk_full(self.path, "the run's metrics", cause=cause)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        record = {"step": step}
        for k, v in metrics.items():
            v = v.item() if isinstance(v, torch.Tensor) else v
            record[k] = v if isinstance(v, (int, str)) or math.isfinite(v) else str(v)
        try:
            self._open().write(json.dumps(record) + "\n")   # a full buffer is written here
        except OSError as e:
            if disk_full_cause(e) is None:
                raise
            raise self._full(e) from e

    @rank_zero_only
    def save(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as e:
                if disk_full_cause(e) is None:
                    raise
                raise self._full(e) from e

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush, fsync and close the file. With `status` "failed" (another exception ends the run) a full disk is
        left to that exception: the lines it loses are past the newest checkpoint, which a resume drops anyway."""
        if self._file is None:
            return
        try:
            self.save()
        except FwError:   # save's full disk
            file, self._file = self._file, None
            with contextlib.suppress(OSError):   # closes the file even though its flush fails again
                file.close()
            if status != "failed":
                raise
            return
        file, self._file = self._file, None
        file.close()

    @rank_zero_only
    def truncate_after(self, step: int) -> None:
        """Drop lines with `step` > `step` (written after the checkpoint a run resumes from); FwError naming the file
        and line of a line it cannot place (`resumed_text`), leaving the file as it is."""
        if self._file is not None:
            self.finalize("resumed")
        if not self.path.exists():
            return
        text, kept = resumed_text(self.path, step)
        if kept != text:
            replace_file(self.path, kept)


_TORN = object()   # the value of a torn last line


class _NotJson(str):
    """The value of a line that is not JSON: why, as a metrics record's problem says it."""


def _values(text: str) -> list[tuple[int, str, Any]]:
    """(line number, line, JSON value) of each non-blank line of a metrics.jsonl's `text`. A torn last line (a run
    killed mid-write: no newline after it) has the value `_TORN`; any other line that is not JSON has a `_NotJson`,
    since no crash leaves one."""
    lines = text.split("\n")
    values: list[tuple[int, str, Any]] = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            values.append((i, ln, json.loads(ln)))
        except json.JSONDecodeError as e:
            # some messages end in "at", which the column completes ("Unterminated string starting at")
            why = f"{e.msg.removesuffix(' at')} at column {e.colno}"
            values.append((i, ln, _TORN if i == len(lines) else _NotJson(why)))
        except (RecursionError, ValueError) as e:   # nested too deep; an integer longer than Python reads
            values.append((i, ln, _NotJson(f"not readable JSON: {e}")))
    return values


def _not_a_record(value: Any) -> str | None:
    """Why a line's JSON value is no metrics record, or None. Its step may be null or missing (a logger's
    `log_metrics` called without one) and any finite number."""
    if isinstance(value, _NotJson):
        return str(value)
    if not isinstance(value, dict):
        return f"{json_type_name(value)}, not an object"
    step = value.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                             or isinstance(step, float) and not math.isfinite(step)):   # an int is finite
        return f"its step is {step!r}, not a finite number"
    return None


def resumed_text(path: str | os.PathLike, step: int) -> tuple[str, str]:
    """The text of metrics.jsonl `path`, and what a run resumed at `step` keeps of it: the lines of the steps up to
    `step`, and those logged without a step before the first line past it (after it, the run logged them past its
    checkpoint and logs them again), each ending in a newline, without blank lines and a torn last line (a run
    killed mid-write).

    Any other line must be a JSON object whose "step" is a number or null: else fw cannot tell whether the line
    comes before the checkpoint, so it is an FwError naming the file and line (and so are bytes that are not
    UTF-8), for the user to fix or delete, rather than a line the resume drops unsaid."""
    try:
        text = decode_utf8(Path(path).read_bytes(), path)
    except OSError as e:
        raise FwError(f"{path}: cannot read the run's metrics: {e.strerror or e}") from None
    kept, past = [], False
    for i, ln, value in _values(text):
        if value is _TORN:
            continue
        problem = _not_a_record(value)
        if problem is not None:
            raise FwError(f"{path}:{i}: not a metrics record ({problem}); a resume expects a JSON object with a "
                          'number or null "step" on every line, to keep those up to its checkpoint\'s step: fix or '
                          "delete the line")
        line_step = value.get("step")
        if line_step is not None:
            past = past or line_step > step
        if (not past) if line_step is None else line_step <= step:
            kept.append(ln + "\n")
    return text, "".join(kept)


def check_resumable(path: str | os.PathLike) -> None:
    """FwError naming the file and line if a resume cannot place a line of metrics.jsonl `path` (`resumed_text`);
    nothing if there is no such file. Read only: a resume checks this at start-up, before it builds or writes."""
    if Path(path).is_file():
        resumed_text(path, 0)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order. A torn last line (a run killed mid-write, which its resume
    drops) is left out; a bad line before it (not JSON, not an object, a step that is no finite number) or bytes
    that are not UTF-8 are an FwError naming the file and line."""
    records = []
    for i, _, value in _values(decode_utf8(Path(path).read_bytes(), path)):
        if value is _TORN:
            continue
        problem = _not_a_record(value)
        if problem is not None:
            raise FwError(f"{path}:{i}: not a metrics record ({problem})")
        records.append(value)
    return records
