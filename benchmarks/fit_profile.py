"""Profile steps of a real `fw fit` run with torch.profiler: where the wall time of a step goes.

    python -m benchmarks.fit_profile --trace fit_trace.json                  # the sft-bf16 workload
    python -m benchmarks.fit_profile --config recipes/sft.yaml --trace t.json --model.policy.preset=tiny \
        --trainer.accelerator=cpu --trainer.precision=32-true               # anything else, on a CPU too

Without --config it runs recipes/sft.yaml as the sft-bf16 workload (`SFT_BF16`: bf16-mixed, Qwen3-0.6B,
8 x 2048 packed rows, metrics logged every step); overrides after it win. The run goes through
`framework.trainer.fit` as `benchmarks.fit_timing` does, with `StepProfiler` appended to the config's
callbacks. It profiles `--steps` policy steps after `--warmup` ones (CPU and CUDA activity) and prints one
markdown table: per step the wall time, the GPU's kernel time and idle fraction, the host's
cudaStreamSynchronize / cudaDeviceSynchronize calls and device-to-host copies, and the host ops of most
self CPU time; with `--stacks`, where each synchronisation (stream, device or event) comes from: the profiler ranges
around it on its thread and its Python frames. `--trace` receives the chrome trace
(chrome://tracing, ui.perfetto.dev).

A step's window runs from one synchronisation at the start of its first batch to the next one (the
profiler's own, in `fw_profile_boundary` ranges, which the counts leave out), so its wall time is the
step's and every kernel it queued ran inside it.
"""
from __future__ import annotations

import argparse
import itertools
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.profiling import kernel_table
from framework.callbacks import Callback

SFT_BF16 = ["--trainer.precision=bf16-mixed", "--model.policy.preset=qwen3-0.6b", "--data.max_seq_len=2048",
            "--data.batch_size=8", "--trainer.log_every_n_steps=1", "--checkpoint.every_n_steps=1000"]
BOUNDARY = "fw_profile_boundary"
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP_OPS = 12
STACK_FRAMES = 4   # Python frames shown per synchronisation site (--stacks)
NO_STACK = "(no Python stack: another thread, or C++ alone)"
OP_FRAMES = 4      # enclosing profiler ranges shown per synchronisation site (--stacks)
PY_FRAME = re.compile(r"\(\d+\): ")   # a Python call as with_stack's tracer names it: "file.py(12): f"


def _python_frame(name: str) -> bool:
    """Whether a profiler event is a Python call of with_stack's tracer ("file.py(12): f", "<built-in ...>")."""
    return PY_FRAME.search(name) is not None or name.startswith("<built-in")


def _parents(event: Any) -> Iterator[Any]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def python_stack(event: Any) -> list[str]:
    """The Python frames `event` ran under, innermost first: its recorded stack where torch keeps one, else the
    Python calls among the ranges around it (torch's tracer records them as events of their own, and CUDA runtime
    calls such as cudaStreamSynchronize have no stack of their own)."""
    if event.stack:
        return list(event.stack)
    return [p.name for p in _parents(event) if PY_FRAME.search(p.name)]


def enclosing_ops(event: Any) -> str:
    """The profiler ranges (ops, record_function) around `event` on its own thread, innermost first, without the
    Python calls: where a synchronisation comes from, also on the autograd engine's thread."""
    names = [p.name for p in _parents(event) if not _python_frame(p.name)][:OP_FRAMES]
    return " < ".join(names) or "(no enclosing op)"


class StepProfiler(Callback):
    """Runs torch.profiler over policy steps `warmup + 1 .. warmup + steps`, marking a synchronised
    boundary at the start of each; `windows()` gives each step's events after the run."""

    def __init__(self, warmup: int = 3, steps: int = 3, trace: str | None = None, stacks: bool = False) -> None:
        self.warmup, self.steps, self.trace, self.stacks = warmup, steps, trace, stacks
        self.prof: profile | None = None
        self.boundaries = 0
        self._step = -1

    @staticmethod
    def _boundary() -> None:
        with record_function(BOUNDARY):
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._step:
            return   # a later micro-batch of the same step
        self._step = step
        if self.prof is None and self.boundaries == 0 and step >= self.warmup:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof = profile(activities=activities, with_stack=self.stacks)
            self.prof.start()
        if self.prof is not None:
            self._boundary()
            self.boundaries += 1
            if self.boundaries > self.steps:
                self._stop()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if self.prof is not None:   # the run ended before the last profiled step's window closed
            self._boundary()
            self.boundaries += 1
            self._stop()

    def _stop(self) -> None:
        self.prof.stop()
        if self.trace:
            self.prof.export_chrome_trace(self.trace)
        self.done, self.prof = self.prof, None

    def windows(self) -> list[dict[str, Any]]:
        """Per profiled step: wall s, kernel s, sync and copy counts, self CPU microseconds by host op."""
        events = list(self.done.events())
        marks = sorted((e for e in events if e.name == BOUNDARY), key=lambda e: e.time_range.start)
        inside_mark = [(m.time_range.start, m.time_range.end) for m in marks]

        def in_mark(e: Any) -> bool:
            return any(a <= e.time_range.start and e.time_range.end <= b for a, b in inside_mark)

        out = []
        for first, last in itertools.pairwise(marks):
            start, end, host_end = first.time_range.end, last.time_range.end, last.time_range.start
            w: dict[str, Any] = {"wall_s": (end - start) / 1e6, "kernel_s": 0.0, "d2h": 0, "h2d": 0,
                                 "self_cpu_us": defaultdict(float), "calls": defaultdict(int),
                                 "sync_sites": defaultdict(int),
                                 **{name: 0 for name in SYNCS}}
            for e in events:
                t = e.time_range.start
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    # a record_function range has a GPU-side twin spanning its kernels: not a kernel itself
                    if not start <= t < end or getattr(e, "is_user_annotation", False):
                        continue
                    if "DtoH" in e.name:
                        w["d2h"] += 1
                    elif "HtoD" in e.name:
                        w["h2d"] += 1
                    elif not e.name.startswith(("Memcpy", "Memset")):
                        w["kernel_s"] += (e.time_range.end - t) / 1e6
                    continue
                if not start <= t < host_end or e.name == BOUNDARY or in_mark(e):
                    continue
                if e.name in SYNCS:
                    w[e.name] += 1
                    if self.stacks:
                        where = " < ".join(python_stack(e)[:STACK_FRAMES]) or NO_STACK
                        w["sync_sites"][f"{e.name} in {enclosing_ops(e)}; {where}"] += 1
                if _python_frame(e.name):   # Python calls of --stacks, not ops
                    continue
                w["self_cpu_us"][e.name] += e.self_cpu_time_total
                w["calls"][e.name] += 1
            out.append(w)
        return out


def table(windows: list[dict[str, Any]], cuda: bool, first_step: int = 1) -> str:
    """One markdown table: a column per profiled step (numbered from `first_step`) and their mean, a row per
    quantity."""
    n = len(windows)
    head = "| | " + " | ".join(f"step {first_step + i}" for i in range(n)) + " | mean |"
    lines = [head, "|---" * (n + 2) + "|"]

    def row(label: str, values: list[float], fmt: str) -> None:
        cells = [fmt.format(v) for v in values] + [fmt.format(sum(values) / max(n, 1))]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("wall s", [w["wall_s"] for w in windows], "{:.4f}")
    if cuda:
        row("GPU busy s (kernels)", [w["kernel_s"] for w in windows], "{:.4f}")
        row("GPU idle fraction", [max(0.0, 1 - w["kernel_s"] / w["wall_s"]) for w in windows], "{:.1%}")
    else:
        lines += [f"| {label} | " + " | ".join(["-"] * (n + 1)) + " |"
                  for label in ("GPU busy s (kernels)", "GPU idle fraction")]
    for name in SYNCS:
        row(f"{name} calls", [w[name] for w in windows], "{:g}")
    row("cudaMemcpy(Async) D2H copies", [w["d2h"] for w in windows], "{:g}")
    row("cudaMemcpy(Async) H2D copies", [w["h2d"] for w in windows], "{:g}")
    totals: dict[str, float] = defaultdict(float)
    for w in windows:
        for name, us in w["self_cpu_us"].items():
            totals[name] += us
    for name in sorted(totals, key=totals.get, reverse=True)[:TOP_OPS]:
        calls = sum(w["calls"][name] for w in windows) / max(n, 1)
        row(f"self CPU ms: `{name}` ({calls:g} calls)", [w["self_cpu_us"][name] / 1e3 for w in windows], "{:.2f}")
    sites: dict[str, int] = defaultdict(int)
    for w in windows:
        for site, count in w["sync_sites"].items():
            sites[site] += count
    if sites:
        lines += ["", "| synchronisations a step | which, in which ops; where (innermost first) |", "|---|---|"]
        lines += [f"| {sites[k] / max(n, 1):g} | `{k}` |" for k in sorted(sites, key=sites.get, reverse=True)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    from framework.config import load_config
    from framework.trainer import fit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None,
                    help="config files (default: recipes/sft.yaml as the sft-bf16 workload)")
    ap.add_argument("--trace", required=True, help="where the chrome trace goes")
    ap.add_argument("--warmup", type=int, default=3, help="policy steps before the profiled ones")
    ap.add_argument("--steps", type=int, default=3, help="policy steps profiled")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also print the N kernels (ops on a CPU) of most device time over the profiled steps")
    ap.add_argument("--stacks", action="store_true",
                    help="record Python stacks and list where each stream / device synchronisation comes from")
    args, overrides = ap.parse_known_args(argv)
    if args.config is None:
        args.config, overrides = ["recipes/sft.yaml"], [*SFT_BF16, *overrides]
    with tempfile.TemporaryDirectory(prefix="fw-fit-profile-") as run_dir:   # unless --run_dir says where
        # one step past the profiled ones, so the last window closes at a batch start like the others
        cfg = load_config(args.config, [f"--run_dir={run_dir}", f"--trainer.max_steps={args.warmup + args.steps + 1}",
                                        *overrides])
        cfg["callbacks"] = [*cfg["callbacks"], {"class_path": "benchmarks.fit_profile.StepProfiler",
                                                "init_args": {"warmup": args.warmup, "steps": args.steps,
                                                              "trace": args.trace, "stacks": args.stacks}}]
        trainer = fit(cfg)
    # built from the config by class_path, so of the module benchmarks.fit_profile, not of __main__
    (profiler,) = [cb for cb in trainer.callbacks if type(cb).__name__ == StepProfiler.__name__]
    cuda = torch.cuda.is_available() and cfg["trainer"]["accelerator"] != "cpu"
    policy = cfg["model"]["policy"]
    device = torch.cuda.get_device_name() if cuda else "CPU"
    out = (f"fw fit profile: recipe {cfg['recipe']}, model {policy['preset'] or policy['path']}, "
           f"{cfg['trainer']['precision']}, {cfg['data']['batch_size']} x {cfg['data']['max_seq_len']}, {device}; "
           f"{args.warmup} warm-up steps\n\n" + table(profiler.windows(), cuda, args.warmup + 1))
    if args.kernels:
        out += f"\n\nTop {args.kernels} kernels over the {args.steps} profiled steps\n" + kernel_table(profiler.done,
                                                                                                   args.kernels)
    print(out, flush=True)
    return out


if __name__ == "__main__":
    main()
