"""Where the GPU idles in a torch.profiler chrome trace, and which host code it waited for.

    python -m benchmarks.fit_profile --config benchmarks/grpo_bench.yaml --trace t.json --stacks --warmup 2 --steps 1
    python -m benchmarks.trace_gaps t.json

A gap is a stretch of a profiled window with no kernel, copy or memset on any stream. Each gap is charged to the
host code that queued the GPU work ending it: the Python frames (the trace's own with `--stacks`), the
`record_function` ranges and the outermost op around that launch, on the thread that made it. The device waited
for the host to get there. A second table charges the same gaps to what the main thread was doing at each gap's
middle (its Python frames, or without them its ranges and innermost op): what the host was busy with meanwhile.
Windows are the stretches between `fw_profile_boundary` ranges (`benchmarks.fit_profile`'s step boundaries), or
the whole trace without them.
"""
from __future__ import annotations

import argparse
import bisect
import itertools
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.fit_profile import BOUNDARY, PY_FRAME

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
# Python frames of the code under study; library frames (torch, lightning, the standard library) are skipped
# in a site's name unless nothing else is there
OWN_FRAME = re.compile(r"(^|/)(framework|recipes|ops_cuda|benchmarks)/[\w/]+\.py\(\d+\)")
FRAMES = 3   # own Python frames per site, innermost first


@dataclass
class Thread:
    """One host thread's ranges, sorted by start, each with the index of the range enclosing it (-1: none)."""

    events: list[dict] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)

    def index(self) -> None:
        self.events.sort(key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.events]
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and self.events[stack[-1]]["ts"] + self.events[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def around(self, t: float) -> list[dict]:
        """The ranges that contain time `t`, outermost first."""
        i = bisect.bisect_right(self.starts, t) - 1
        out = []
        while i >= 0:
            e = self.events[i]
            if e["ts"] <= t <= e["ts"] + e["dur"]:
                out.append(e)
            i = self.parent[i]
        return out[::-1]


def load(path: str | Path) -> list[dict]:
    """The complete ('X') events of a chrome trace file, with numeric ts and dur."""
    raw = json.loads(Path(path).read_text())
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    out = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        e["ts"], e["dur"] = float(e["ts"]), float(e.get("dur", 0.0))
        out.append(e)
    return out


def windows(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) µs of each profiled window: from one boundary range's end to the next one's; the whole trace
    when there are fewer than two boundaries."""
    marks = sorted((e for e in events if e["name"] == BOUNDARY and e.get("cat") != "gpu_user_annotation"),
                   key=lambda e: e["ts"])
    if len(marks) >= 2:
        return [(a["ts"] + a["dur"], b["ts"] + b["dur"]) for a, b in itertools.pairwise(marks)]
    span = [e for e in events if e.get("cat") in GPU_CATS + HOST_CATS]
    return [(min(e["ts"] for e in span), max(e["ts"] + e["dur"] for e in span))] if span else []


def gaps(busy: list[dict], start: float, end: float, host_end: float) -> list[tuple[float, float, dict | None]]:
    """The device's idle stretches in [start, end]: (from, to, the GPU event that ends it). `busy` is sorted by
    start. Idle time after the window's last GPU event counts up to `host_end` (the host's own end of the window),
    with no event ending it."""
    out: list[tuple[float, float, dict | None]] = []
    t = start
    for e in busy:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b <= start or a >= end:
            continue
        if a > t:
            out.append((t, a, e))
        t = max(t, b)
    if t < host_end:
        out.append((t, host_end, None))
    return out


def frames(stack: list[dict]) -> list[str]:
    """The Python frames among `stack`'s ranges, innermost first: the code under study's when there are some."""
    py = [e["name"] for e in stack if e.get("cat") == "python_function" and PY_FRAME.search(e["name"])][::-1]
    own = [f for f in py if OWN_FRAME.search(f)]
    return [_short(f) for f in (own or py)[:FRAMES]]


def _short(frame: str) -> str:
    m = OWN_FRAME.search(frame)
    return frame[m.start(2):] if m else frame


def _ranges(stack: list[dict]) -> list[str]:
    """The record_function ranges among `stack`'s, innermost first, without fit_profile's step boundaries."""
    return [e["name"] for e in stack if e.get("cat") == "user_annotation" and e["name"] != BOUNDARY][::-1]


def site(stack: list[dict]) -> str:
    """A launch's place: its Python frames, its record_function ranges (innermost first) and its outermost op."""
    ranges = _ranges(stack)
    ops = [e["name"] for e in stack if e.get("cat") == "cpu_op"]
    parts = [" < ".join(frames(stack)) or "(no Python frame)"]
    if ranges:
        parts.append("ranges " + " < ".join(ranges[:2]))
    if ops:
        parts.append("op " + ops[0])
    return "; ".join(parts)


def busy_with(stack: list[dict]) -> str:
    """What a thread was doing: its Python frames, else its record_function ranges and innermost op."""
    py = frames(stack)
    if py:
        return " < ".join(py)
    ranges = _ranges(stack)
    ops = [e["name"] for e in stack if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    parts = (["ranges " + " < ".join(ranges[:2])] if ranges else []) + (["op " + ops[-1]] if ops else [])
    return "; ".join(parts) or "(outside every range and op)"


def analyse(events: list[dict], min_us: float = 0.0) -> dict[str, Any]:
    """Per window: wall µs and idle µs; over all windows, idle µs and gap counts by launch site and by what the main
    thread was doing at each gap's middle (`busy_with`). Gaps shorter than `min_us` count in the totals only."""
    busy = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    threads: dict[Any, Thread] = defaultdict(Thread)
    for e in events:
        if e.get("cat") in HOST_CATS:
            threads[(e.get("pid"), e.get("tid"))].events.append(e)
    for th in threads.values():
        th.index()
    marks = [e for e in events if e["name"] == BOUNDARY and e.get("cat") == "user_annotation"]
    main = (marks[0].get("pid"), marks[0].get("tid")) if marks else None
    if main is None and threads:   # the thread with the most Python frames
        main = max(threads, key=lambda k: sum(e.get("cat") == "python_function" for e in threads[k].events))
    by_launch: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_host: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    report: dict[str, Any] = {"windows": [], "by_launch": by_launch, "by_host": by_host}
    for start, end in windows(events):
        host_end = max((e["ts"] for e in marks if start <= e["ts"] < end), default=end)
        idle = 0.0
        for a, b, nxt in gaps(busy, start, end, host_end):
            idle += b - a
            if b - a < min_us:
                continue
            launch = launches.get(nxt.get("args", {}).get("correlation")) if nxt is not None else None
            if launch is None:
                where = "(window's end: the host's last work)" if nxt is None else "(launch not in the trace)"
            else:
                where = site(threads[(launch.get("pid"), launch.get("tid"))].around(launch["ts"]))
            by_launch[where][0] += b - a
            by_launch[where][1] += 1
            host = busy_with(threads[main].around((a + b) / 2)) if main in threads else "(no main thread)"
            by_host[host][0] += b - a
            by_host[host][1] += 1
        report["windows"].append({"wall_us": end - start, "idle_us": idle})
    return report


def tables(report: dict[str, Any], top: int = 20) -> str:
    """Markdown: the windows' wall and idle time, then the `top` sites of each breakdown, per window."""
    n = max(len(report["windows"]), 1)
    wall = sum(w["wall_us"] for w in report["windows"]) / n / 1e3
    idle = sum(w["idle_us"] for w in report["windows"]) / n / 1e3
    lines = [(f"{len(report['windows'])} window(s): wall {wall:.2f} ms, GPU idle {idle:.2f} ms a window "
             f"({idle / max(wall, 1e-9):.1%})"), ""]
    for key, title in (("by_launch", "the launch that ended the gap (frames, ranges; op)"),
                       ("by_host", "the main thread at the gap's middle (frames, else ranges; op)")):
        rows = sorted(report[key].items(), key=lambda kv: kv[1][0], reverse=True)
        lines += [f"| idle ms a window | gaps | {title} |", "|---|---|---|"]
        lines += [f"| {us / n / 1e3:.2f} | {count / n:g} | `{name}` |" for name, (us, count) in rows[:top]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a chrome trace from torch.profiler (benchmarks.fit_profile --trace)")
    ap.add_argument("--top", type=int, default=20, help="sites shown per table")
    ap.add_argument("--min-us", type=float, default=5.0, help="shorter gaps count in the totals only")
    args = ap.parse_args(argv)
    out = tables(analyse(load(args.trace), args.min_us), args.top)
    print(out)
    return out


if __name__ == "__main__":
    main()
