"""`Timeline`: timestamps on the device's stream around each prefill and decode step a rollout queues, to tell
where its wall time goes (the forward, the sampler, the device waiting for the host) without a profiler.

On CUDA a mark is an event recorded on the current stream, so it reads the device's clock at the point the
stream reaches it: the time between one step's end and the next one's start is time the device had nothing
queued. The host's clock is read at each mark too, so a step's host time (building its inputs and queueing it)
stands beside its device time. On CPU, where every op runs as it is called, both are the host's clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


def parts_text(parts: dict[str, float]) -> str:
    """A summary's `setup_parts` or `finish_parts` as "name seconds, ..." in their order."""
    return ", ".join(f"{name} {seconds:.3f}" for name, seconds in parts.items())


@dataclass
class Step:
    """One queued step: its kind, its rows and its size in tokens."""

    kind: str                    # "prefill" | "decode"
    rows: int
    tokens: int                  # decode: the context positions its rows attend (the KV it reads); prefill: the
                                 # tokens it computes
    bucket: int                  # the batch size it ran at (decode: the graph bucket)
    marks: list[Any] = field(default_factory=list)    # device marks: start, forward done, sampled
    host: list[float] = field(default_factory=list)   # host clock at the same three points


@dataclass
class Call:
    """One `generate` call: host clock at its entry and exit, the index of its first step, and the host clock where
    each named part of its work outside the steps ended (`Timeline.host`)."""

    first: int
    host: list[float] = field(default_factory=list)
    parts: list[tuple[str, float]] = field(default_factory=list)


class Timeline:
    """Marks around every step of the `generate` calls of the engine it is given to (`engine.timeline`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.calls: list[Call] = []
        self.steps: list[Step] = []
        self.waited = 0.0       # host seconds blocked on the device (reading a step's tokens back)
        self.captured = 0.0     # host seconds capturing decode graphs
        self.captures = 0

    def _mark(self, step: Step) -> None:
        step.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            step.marks.append(event)
        else:
            step.marks.append(step.host[-1])

    def enter(self) -> None:
        """At a `generate` call's entry."""
        self.calls.append(Call(len(self.steps), [time.perf_counter()]))

    def exit(self) -> None:
        """At its return, the rollout's tensors built."""
        self.calls[-1].host.append(time.perf_counter())

    def host(self, part: str) -> None:
        """Where the call's host work named `part` ends, before its first step or after its last: the summary splits
        the host seconds outside the steps by these (what is left before the first step counts as "admission", what
        is left after the last mark as "result")."""
        self.calls[-1].parts.append((part, time.perf_counter()))

    def begin(self, kind: str, rows: int, tokens: int, bucket: int) -> None:
        """Before the step's first device op: the device's wait for the host falls before this mark."""
        self.steps.append(Step(kind, rows, tokens, bucket))
        self._mark(self.steps[-1])

    def forward_done(self) -> None:
        self._mark(self.steps[-1])

    def end(self) -> None:
        self._mark(self.steps[-1])

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def summary(self) -> dict:
        """Per kind (and for decode per bucket): steps, rows and tokens summed, device seconds of the forward and of the
        sampler, host seconds queueing; and the device's idle seconds between steps, over the whole span."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict = {"waited_s": self.waited, "captured_s": self.captured, "captures": self.captures,
                     "idle_s": 0.0, "span_s": 0.0}
        for kind in ("prefill", "decode"):
            out[kind] = {"steps": 0, "rows": 0, "tokens": 0, "forward_s": 0.0, "sample_s": 0.0, "host_s": 0.0,
                         "by_bucket": {}}
        done = [s for s in self.steps if len(s.marks) == 3]
        for prev, s in zip([None] + done[:-1], done):
            d = out[s.kind]
            fwd, smp = self._seconds(s.marks[0], s.marks[1]), self._seconds(s.marks[1], s.marks[2])
            d["steps"] += 1
            d["rows"] += s.rows
            d["tokens"] += s.tokens
            d["forward_s"] += fwd
            d["sample_s"] += smp
            d["host_s"] += s.host[2] - s.host[0]
            b = d["by_bucket"].setdefault(s.bucket, {"steps": 0, "rows": 0, "tokens": 0, "forward_s": 0.0})
            b["steps"] += 1
            b["rows"] += s.rows
            b["tokens"] += s.tokens
            b["forward_s"] += fwd
            if prev is not None:
                out["idle_s"] += max(0.0, self._seconds(prev.marks[2], s.marks[0]))
        if done:
            out["span_s"] = self._seconds(done[0].marks[0], done[-1].marks[2])
        # host seconds of the calls outside their steps: before the first step is queued (the pool, the
        # scheduler, the tables), and after the last one (reading back its tokens, building the rollout), each split
        # by the parts the engine marks
        out.update(calls=0, call_s=0.0, setup_s=0.0, finish_s=0.0, setup_parts={}, finish_parts={})
        ends = [c.first for c in self.calls[1:]] + [len(self.steps)]
        for c, end in zip(self.calls, ends):
            if len(c.host) < 2 or end <= c.first or len(self.steps[end - 1].host) < 3:
                continue
            first, last = self.steps[c.first].host[0], self.steps[end - 1].host[2]
            out["calls"] += 1
            out["call_s"] += c.host[1] - c.host[0]
            out["setup_s"] += first - c.host[0]
            out["finish_s"] += c.host[1] - last
            for key, start, stop, rest in (("setup_parts", c.host[0], first, "admission"),
                                           ("finish_parts", last, c.host[1], "result")):
                t, parts = start, out[key]
                for name, at in c.parts:
                    if start <= at <= stop:
                        parts[name] = parts.get(name, 0.0) + at - t
                        t = at
                parts[rest] = parts.get(rest, 0.0) + stop - t
        return out
