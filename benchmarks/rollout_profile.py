"""Where a rollout's wall time goes: one `RolloutEngine.generate` call under torch.profiler.

    python -m benchmarks.rollout_profile --num-seqs 256 --lo 100 --hi 1024 --kv-cache-gib 16 --trace ro.json
    python -m benchmarks.rollout_profile --preset tiny --num-seqs 16 --lo 8 --hi 32 --trace ro.json   # CPU too

The workload is `benchmarks.rollout`'s (random prompts and per-row output lengths, EOS ignored). One
unprofiled call first (the graphs of the buckets it meets are captured and kept), then one profiled call on
the same engine, or with `--fresh` on a new one, as each GRPO/PPO rollout is (its pool allocated and its graphs
captured inside the call). Printed: the call's wall time and tokens/s; the host time inside the engine's phases
(`fw.rollout.prefill`, `fw.rollout.decode`, `fw.rollout.capture` within it: the decode graphs captured,
`fw.rollout.receive`, which waits for the device's previous step) with their counts;
on CUDA the kernels' total time, the GPU's idle share and the kernels of most time; the most rows that ran
together, the call's preemptions and the pool's blocks. `--trace` receives the chrome trace.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.rollout import workload
from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config
from framework.rollout import CacheSettings, RolloutEngine, SamplingParams

PHASES = ("fw.rollout.prefill", "fw.rollout.decode", "fw.rollout.capture", "fw.rollout.receive")
TOP_KERNELS = 10


def summarize(prof: profile, wall: float, tokens: int, cuda: bool) -> str:
    """The markdown report of one profiled call."""
    host: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False) or e.name.startswith(("Memcpy", "Memset")):
                continue
            kernels[e.name][0] += (e.time_range.end - e.time_range.start) / 1e6
            kernels[e.name][1] += 1
        elif e.name in PHASES:
            host[e.name][0] += (e.time_range.end - e.time_range.start) / 1e6
            host[e.name][1] += 1
    lines = [f"wall {wall:.3f} s, {tokens / wall:.0f} output tokens/s", "", "| host phase | s | calls | ms a call |",
             "|---|---|---|---|"]
    for name in PHASES:
        s, n = host[name]
        lines.append(f"| `{name}` | {s:.3f} | {n} | {1e3 * s / max(n, 1):.3f} |")
    if cuda:
        busy = sum(s for s, _ in kernels.values())
        lines += ["", f"kernels {busy:.3f} s, GPU idle {max(0.0, 1 - busy / wall):.1%} of the wall time", "",
                  "| kernel | s | calls |", "|---|---|---|"]
        for name in sorted(kernels, key=lambda k: kernels[k][0], reverse=True)[:TOP_KERNELS]:
            lines.append(f"| `{name[:90]}` | {kernels[name][0]:.3f} | {kernels[name][1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--lo", type=int, default=100)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--trace", required=True, help="where the chrome trace goes")
    ap.add_argument("--fresh", action="store_true",
                    help="profile a call on a new engine, as each GRPO/PPO rollout is: its pool allocated and its "
                         "decode graphs captured inside the call")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32).to("cuda" if cuda else "cpu").eval()
    prompts, outs = workload(args.num_seqs, args.lo, args.hi, cfg.vocab_size)
    base = CacheSettings.from_config(None)
    engine = RolloutEngine(model, CacheSettings(args.kv_cache_gib, base.max_num_seqs, base.block_size))
    params = SamplingParams(max_new_tokens=outs, temperature=args.temperature)
    engine.generate(prompts, params, seed=0)
    if args.fresh:
        engine.release()
        engine = RolloutEngine(model, engine.settings)
    before = engine.preemptions
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params, seed=0)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(args.trace)
    report = summarize(prof, wall, sum(outs), cuda)
    report += (f"\n\npeak rows {engine.peak_rows}, preemptions {engine.preemptions - before}, "
               f"KV blocks {engine.cache.num_blocks}")
    engine.release()
    print(report)
    return report


if __name__ == "__main__":
    main()
