"""Time a real `fw fit` run: wall time per policy optimizer step, peak GPU memory against the memory plan's
estimate, logged throughput.

    python -m benchmarks.fit_timing --config recipes/sft.yaml [--config more.yaml] [--a.b=v ...]

The `StepTimer` callback of examples/step_timer.py is appended to the config's callbacks (the same
`class_path` mechanism users have); the summary reads its `step_times.json` and the run's `metrics.jsonl`.
The first step (kernels, allocator, autotuning) is reported apart from the median of the later ones. Peak memory
is the run's largest `memory/peak_gib` (torch.cuda.max_memory_allocated) and `memory/reserved_gib` in
metrics.jsonl, beside `framework.memory_plan.estimate(cfg)`'s total in torch's allocator. A host probe ends the
report: the µs the host takes to queue one small op on the run's device (`host_probe`), which says how fast the
machine's CPU was, since the eager parts of a step wait on it.

With --rollout-timeline an RL run's rollout engine carries a `framework.rollout.timeline.Timeline` each step
(`RolloutTimeline` below, written to <run_dir>/rollout_timeline.json): where the rollout's wall time goes;
`--rollout-kernels K` adds the kernels of batch K's rollout under torch.profiler.

With --step-spans a `framework.spans.SpanClock` runs through the whole fit (`StepSpans` below, written to
<run_dir>/step_spans.json): per step, each named span's host and device seconds and how far the device trailed the
host at its ends, the step's own phases timed without a profiler.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from framework.callbacks import Callback
from framework.rollout.timeline import Timeline, parts_text
from framework.spans import SpanClock


class ProfiledTimeline(Timeline):
    """A Timeline that also runs torch.profiler over each generate call it sees (CUDA kernels only)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.prof: Any = None

    def enter(self) -> None:
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.prof.__enter__()
        super().enter()

    def exit(self) -> None:
        super().exit()
        torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)


class RolloutTimeline(Callback):
    """A fresh Timeline on the recipe's rollout engine for every training batch; each batch's summary goes to
    <run_dir>/rollout_timeline.json. With `kernels_at` (a batch index) that batch's rollout also runs under
    torch.profiler and its kernels, per decode step, go to <run_dir>/rollout_kernels.md."""

    def __init__(self, kernels_at: int = -1) -> None:
        self.summaries: list[dict] = []
        self.timeline: Timeline | None = None
        self.kernels_at = kernels_at

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        engine_of = getattr(module.recipe, "rollout_engine", None)
        if engine_of is not None:
            kind = ProfiledTimeline if batch_idx == self.kernels_at and module.device.type == "cuda" else Timeline
            self.timeline = kind(module.device)
            engine_of(module.policy).timeline = self.timeline

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.timeline is None:
            return
        summary = self.timeline.summary()
        self.summaries.append(summary)
        out = Path(trainer.default_root_dir) / "rollout_timeline.json"
        out.write_text(json.dumps(self.summaries, default=str))
        if isinstance(self.timeline, ProfiledTimeline) and self.timeline.prof is not None:
            from benchmarks.rollout_profile import kernel_table

            steps = max(summary["decode"]["steps"], 1)
            lines = kernel_table(self.timeline.prof, steps, f"batch {batch_idx}'s rollout, per decode step (the "
                                 f"prefill's kernels spread over its {steps} decode steps)", "a step")
            (Path(trainer.default_root_dir) / "rollout_kernels.md").write_text("\n".join(lines) + "\n")


BETWEEN = "fit.batch_end_to_next"   # StepSpans' own span


class StepSpans(Callback):
    """A SpanClock from the start of training to its end, a boundary at every training batch's start; the steps
    between boundaries go to <run_dir>/step_spans.json at the end."""

    def __init__(self) -> None:
        self.clock: SpanClock | None = None

    def on_train_start(self, trainer, module) -> None:
        self.clock = SpanClock(module.device).start()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx:
            self.clock.mark(BETWEEN, begin=False)
        self.clock.boundary()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        # from here (after the batch-end hooks of the callbacks before this one, the metrics' flush among them) to the
        # next batch's start: the later callbacks' hooks, Lightning's loop and the next batch's fetch
        self.clock.mark(BETWEEN, begin=True)

    def on_exception(self, trainer, module, exception) -> None:
        if self.clock is not None:   # a fit that failed leaves no clock running for the next one
            self.clock.stop()

    def on_train_end(self, trainer, module) -> None:
        self.clock.mark(BETWEEN, begin=False)
        self.clock.boundary()
        self.clock.stop()
        (Path(trainer.default_root_dir) / "step_spans.json").write_text(json.dumps(self.clock.steps()))


def span_lines(steps: list[dict]) -> list[str]:
    """Medians over the later steps of each span's calls, host and device seconds and the device's lag at its ends,
    largest device time first."""
    later = steps[1:] or steps
    names = sorted({n for s in later for n in s["spans"]},
                   key=lambda n: -statistics.median(s["spans"].get(n, {}).get("device_s", 0.0) for s in later))

    def m(name: str, key: str) -> float:
        return statistics.median(s["spans"][name][key] for s in later if name in s["spans"])

    lines = [(f"  step spans (median of {len(later)} later steps; lag: how far the device trailed the host at a "
             "span's begin / end, ms)"),
             (f"    {'step, batch start to next':<28} host {statistics.median(s['host_s'] for s in later):.3f} s, "
             f"device {statistics.median(s['device_s'] for s in later):.3f} s")]
    for n in names:
        lines.append(f"    {n:<28} host {m(n, 'host_s'):.3f} s, device {m(n, 'device_s'):.3f} s, "
                     f"{m(n, 'calls'):.0f} calls, lag {1e3 * m(n, 'lag_begin_s'):.1f} / {1e3 * m(n, 'lag_end_s'):.1f}")
    return lines


def timeline_lines(summaries: list[dict]) -> list[str]:
    """Medians over the later steps' rollouts of where their wall time went."""
    later = summaries[1:] or summaries

    def m(key: str, kind: str | None = None) -> float:
        return statistics.median((s[kind] if kind else s)[key] for s in later)

    def parts(key: str) -> str:
        names = dict.fromkeys(n for s in later for n in s.get(key, {}))
        return parts_text({n: statistics.median(s.get(key, {}).get(n, 0.0) for s in later) for n in names})

    sampler = statistics.median(s["decode"]["sample_s"] + s["prefill"]["sample_s"] for s in later)
    return [f"  rollout timeline (median of {len(later)} later steps, seconds):",
            f"    generate wall           {m('call_s'):.3f}",
            f"    host before 1st step    {m('setup_s'):.3f} ({parts('setup_parts')})",
            f"    device span of steps    {m('span_s'):.3f} (idle in it {m('idle_s'):.3f})",
            f"    host after last step    {m('finish_s'):.3f} ({parts('finish_parts')})",
            f"    prefill forward         {m('forward_s', 'prefill'):.3f} over {m('steps', 'prefill'):.0f} steps",
            (f"    decode forward          {m('forward_s', 'decode'):.3f} over {m('steps', 'decode'):.0f} steps; "
             f"sampler {sampler:.3f}"),
            f"    graph captures          {m('captures'):.0f} in {m('captured_s'):.3f}"]


def _median(records: list[dict], key: str, skip_first: bool = True) -> float | None:
    values = [r[key] for r in records if key in r]
    values = values[1:] if skip_first and len(values) > 1 else values
    return statistics.median(values) if values else None


def report(cfg: dict, plan_gib: float | None = None) -> str:
    """The run's summary; `plan_gib`: the memory plan's estimate of the peak in torch's allocator."""
    run_dir = Path(cfg["run_dir"])
    times = json.loads((run_dir / "step_times.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = times["step_seconds"]
    later = steps[1:] or steps
    policy = cfg["model"]["policy"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [(f"fw fit timing: recipe {cfg['recipe']}, model {policy['preset'] or policy['path']}, "
              f"{cfg['trainer']['precision']}, {device}"),
             f"  first step (warm-up)  {steps[0]:.3f} s",
             f"  median later step     {statistics.median(later):.3f} s over {len(later)} steps"]
    for key, label, fmt in (("tokens_per_s", "tokens/s (logged)", "{:.0f}"),
                            ("rollout/tokens_per_s", "rollout tokens/s", "{:.0f}"),
                            ("rollout/seconds", "rollout seconds", "{:.2f}"),
                            ("mismatch/mean", "logprob mismatch mean", "{:.2e}"),
                            ("mismatch/max", "logprob mismatch max", "{:.2e}"),
                            ("loss", "loss (last logged)", None),
                            ("reward/mean", "reward mean (last logged)", None)):
        if fmt is None:
            values = [r[key] for r in records if key in r]
            if values:
                lines.append(f"  {label:<26}{values[0]:.4f} -> {values[-1]:.4f}")
            continue
        value = _median(records, key)
        if value is not None:
            lines.append(f"  {label:<26}" + fmt.format(value) + " (median of later logged steps)")
    peaks = [r["memory/peak_gib"] for r in records if "memory/peak_gib" in r]
    reserved = [r["memory/reserved_gib"] for r in records if "memory/reserved_gib" in r]
    if peaks:
        lines.append(f"  peak GPU memory           {max(peaks):.1f} GiB allocated, {max(reserved):.1f} GiB reserved")
    if plan_gib is not None:
        ratio = f" ({plan_gib / max(peaks):.2f}x the measured peak)" if peaks else ""
        lines.append(f"  memory plan estimate      {plan_gib:.1f} GiB allocated{ratio}")
    timeline = run_dir / "rollout_timeline.json"
    if timeline.exists() and (summaries := json.loads(timeline.read_text())):
        lines += timeline_lines(summaries)
    spans = run_dir / "step_spans.json"
    if spans.exists() and (steps_spans := json.loads(spans.read_text())):
        lines += span_lines(steps_spans)
    kernels = run_dir / "rollout_kernels.md"
    if kernels.exists():
        lines += ["  " + line for line in kernels.read_text().splitlines()]
    return "\n".join(lines)


def host_probe(device: str, launches: int = 10_000, rounds: int = 5) -> list[float]:
    """µs the host takes to queue one small op on `device` (an in-place add to one element), in each of `rounds`
    runs of `launches`. The eager parts of a step (the RL update's forwards and backwards) are queued about as fast
    as the GPU runs them, so their time follows the host's speed, which differs between machines of one GPU kind:
    this figure beside a step time says how fast the host was."""
    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        times.append((time.perf_counter() - t0) / launches * 1e6)
    sync()
    return times


def probe_line(device: str) -> str:
    times = host_probe(device)
    return (f"  host probe                {statistics.median(times):.2f} us to queue a one-element add on {device} "
            f"(median of {len(times)} runs: {', '.join(f'{t:.2f}' for t in times)})")


def main(argv: list[str] | None = None) -> None:
    from framework.errors import FwError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Dotted overrides as fw fit takes them follow, e.g. --run_dir=/tmp/runs/t1 "
                                        "--trainer.max_steps=10 (a run_dir holding another run's checkpoints is "
                                        "refused, as fw fit refuses it).")
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--rollout-timeline", action="store_true", help="time the rollout's steps (RL recipes)")
    ap.add_argument("--rollout-kernels", type=int, default=-1, metavar="BATCH",
                    help="with --rollout-timeline: profile the kernels of this batch's rollout (CUDA)")
    ap.add_argument("--step-spans", action="store_true",
                    help="time each step's named spans on the host and the device (framework.spans)")
    args, overrides = ap.parse_known_args(argv)
    try:
        run(args, overrides)
    except FwError as e:   # a config or run_dir refused: one line, as fw says it
        print(f"fit_timing: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace, overrides: list[str]) -> None:
    from framework.config import load_config, uses_cuda
    from framework.memory_plan import GIB, estimate
    from framework.trainer import fit

    cfg = load_config(args.config, overrides)
    cfg["callbacks"] = [*cfg["callbacks"], {"class_path": "examples.step_timer.StepTimer", "init_args": {}}]
    if args.rollout_timeline:
        cfg["callbacks"].append({"class_path": "benchmarks.fit_timing.RolloutTimeline",
                                 "init_args": {"kernels_at": args.rollout_kernels}})
    if args.step_spans:
        cfg["callbacks"].append({"class_path": "benchmarks.fit_timing.StepSpans", "init_args": {}})
    plan = estimate(cfg)
    fit(cfg, keep_on_device=True)   # as `fw fit` runs it: the process ends after the report
    device = "cuda" if uses_cuda(cfg["trainer"]) else "cpu"
    print("\n" + report(cfg, plan.allocated_bytes / GIB) + "\n" + probe_line(device), flush=True)


if __name__ == "__main__":
    main()
