"""Named spans of a training step (`span`): each is a torch.profiler range, and while a `SpanClock` runs, a pair
of marks that time the span on the host and on the device without a profiler, whose own host work distorts
exactly what a host-bound step spends.

A mark reads the host's clock and records an event on the current stream. One synchronisation when the clock
starts puts both clocks on one axis, so at every mark the device's lag behind the host is known: the time from the
host queueing the mark to the device reaching it. Where that lag is near zero the device had caught up and was
waiting for the host; where it is large the host was ahead. On CPU, where every op runs as it is called, both
clocks are the host's.
"""
from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

_clock: SpanClock | None = None   # the running clock, if any: read by every `span`


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """A profiler range named `name`, and a pair of marks on the running `SpanClock`, if any."""
    with record_function(name):
        clock = _clock
        if clock is None:
            yield
            return
        clock.mark(name, begin=True)
        try:
            yield
        finally:
            clock.mark(name, begin=False)


@dataclass
class Mark:
    name: str
    begin: bool
    host: float          # perf_counter seconds
    event: Any           # a CUDA event, or None on CPU


class SpanClock:
    """Marks every `span` entered while it runs (`start` .. `stop`); `boundary` splits them into steps."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[Mark] = []
        self._ref: Any = None
        self._ref_host = 0.0

    def start(self) -> SpanClock:
        """Runs the clock (one device synchronisation, to align the device's clock with the host's)."""
        global _clock
        if _clock is not None and _clock is not self:
            raise RuntimeError("another SpanClock is running")
        if self.cuda:
            torch.cuda.synchronize()
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
        self._ref_host = time.perf_counter()
        _clock = self
        return self

    def stop(self) -> None:
        global _clock
        if _clock is self:
            _clock = None

    def mark(self, name: str, begin: bool) -> None:
        event = None
        host = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append(Mark(name, begin, host, event))

    def boundary(self) -> None:
        """Where one step ends and the next begins (a mark named "step")."""
        self.mark("step", begin=True)

    def _device(self, m: Mark) -> float:
        """When the device reached `m`, on the host's clock."""
        if not self.cuda:
            return m.host
        return self._ref_host + self._ref.elapsed_time(m.event) / 1e3

    def steps(self) -> list[dict]:
        """Per step (between consecutive boundaries; waits for the device once): its host and device seconds, and per
        span name its calls, host seconds, device seconds (summed over its calls; a span inside another counts in
        both) and the device's lag behind the host at the span's ends (medians, seconds)."""
        if self.cuda:
            torch.cuda.synchronize()
        cuts = [i for i, m in enumerate(self.marks) if m.name == "step"]
        out = []
        for a, b in itertools.pairwise(cuts):
            lo, hi = self.marks[a], self.marks[b]
            step: dict = {"host_s": hi.host - lo.host, "device_s": self._device(hi) - self._device(lo),
                          "spans": {}}
            open_marks: dict[str, list[Mark]] = {}
            lags: dict[str, dict[str, list[float]]] = {}
            for m in self.marks[a + 1:b]:
                lag = self._device(m) - m.host
                if m.begin:
                    open_marks.setdefault(m.name, []).append(m)
                    lags.setdefault(m.name, {"begin": [], "end": []})["begin"].append(lag)
                    continue
                stack = open_marks.get(m.name)
                if not stack:
                    continue   # entered before this step's boundary
                first = stack.pop()
                p = step["spans"].setdefault(m.name, {"calls": 0, "host_s": 0.0, "device_s": 0.0})
                p["calls"] += 1
                p["host_s"] += m.host - first.host
                p["device_s"] += self._device(m) - self._device(first)
                lags[m.name]["end"].append(lag)
            for name, p in step["spans"].items():
                p["lag_begin_s"] = statistics.median(lags[name]["begin"])
                p["lag_end_s"] = statistics.median(lags[name]["end"])
            out.append(step)
        return out
