"""Where a rollout's wall time goes: one `RolloutEngine.generate` call with a `Timeline` of its steps, and the
kernels of its decode step under torch.profiler.

    python -m benchmarks.rollout_profile --num-seqs 256 --lo 100 --hi 1024 --kv-cache-gib 16 --kernels 5
    python -m benchmarks.rollout_profile --num-seqs 256 --group 8 --prompt-len 116 --new-tokens 256 --mixed
    python -m benchmarks.rollout_profile --preset tiny --num-seqs 16 --lo 8 --hi 32     # CPU too

The workload is `benchmarks.rollout`'s (random prompts and per-row output lengths, EOS ignored), or with
`--prompt-len` / `--new-tokens` fixed lengths, and with `--group G` each prompt repeated G times in a row, as a
GRPO group is (the second line is grpo-bench-v1's rollout: 32 prompts x 8). `--mixed` keeps float32 weights and
runs under bf16 autocast, as `fw fit` with bf16-mixed does. One untimed call first (the decode graphs of the
buckets it meets are captured and kept), then the timed call on the same engine, as a GRPO/PPO rollout of a
kept engine runs (`rollout.keep_engine`), or with `--fresh` on a new one, as a rollout whose engine is handed back
after each call runs (pool allocated and graphs captured inside the call).

The timed call carries a `framework.rollout.timeline.Timeline`: device time of each step's forward and sampler,
host time queueing it, the device's idle time between steps (it waited for the host), the host's time blocked
on the device, and the graphs captured. Per decode bucket: steps, rows, context and the bytes a step must read
(the weights once and every row's keys and values) against its forward time. `--kernels N` profiles N replays
of the largest bucket's decode graph with the sampler and lists the kernels of one step; `--trace` writes
that profile's chrome trace. `--prefill-kernels R` lists the kernels and the host operators (self CPU time) of
a call that only prefills the first R prompts (one new token each).
"""
from __future__ import annotations

import argparse
import contextlib
import random
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.rollout import workload
from framework.models import Qwen3ForCausalLM
from framework.models.presets import PRESETS, preset_config
from framework.rollout import CacheSettings, RolloutEngine, SamplingParams
from framework.rollout.kv_cache import KV_CACHE_DTYPES
from framework.rollout.sampling import draw
from framework.rollout.timeline import Timeline, parts_text

TOP_KERNELS = 14


def prompts_and_lengths(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The call's prompts and per-row output lengths (see the module's docstring)."""
    n_prompts = -(-args.num_seqs // args.group)
    prompts, outs = workload(n_prompts, args.lo, args.hi, vocab)
    rng = random.Random(1)
    if args.prompt_len:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in prompts]
    if args.new_tokens:
        outs = [args.new_tokens] * len(outs)
    prompts = [p for p in prompts for _ in range(args.group)][:args.num_seqs]
    outs = [n for n in outs for _ in range(args.group)][:args.num_seqs]
    return prompts, outs


def step_bytes(model: torch.nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the weights a decode step reads once, in the compute `dtype`; bytes of keys and values per context
    position, in the pool's `kv_dtype`)."""
    c = model.config
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2) * dtype.itemsize   # the tied LM head once
    return weights, 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_dtype.itemsize


def timeline_report(s: dict, wall: float, tokens: int, weight_bytes: int, kv_bytes: int) -> list[str]:
    lines = [(f"wall {wall:.3f} s, {tokens / wall:.0f} output tokens/s; device span of the steps {s['span_s']:.3f} s, "
             f"idle between steps {s['idle_s']:.3f} s ({s['idle_s'] / max(wall, 1e-9):.1%} of the wall time)"),
             (f"host: blocked on the device {s['waited_s']:.3f} s; {s['captures']} decode graphs captured in "
             f"{s['captured_s']:.3f} s; outside the steps: {s['setup_s']:.3f} s before the first "
             f"({parts_text(s['setup_parts'])}), {s['finish_s']:.3f} s after the last "
             f"({parts_text(s['finish_parts'])})"),
             "",
             ("| phase | steps | rows a step | device forward s | device sampler s | host queueing s | "
             "device ms a step | host ms a step |"), "|---|---|---|---|---|---|---|---|"]
    for kind in ("prefill", "decode"):
        d = s[kind]
        n = max(d["steps"], 1)
        lines.append(f"| {kind} | {d['steps']} | {d['rows'] / n:.1f} | {d['forward_s']:.3f} | {d['sample_s']:.3f} | "
                     f"{d['host_s']:.3f} | {1e3 * (d['forward_s'] + d['sample_s']) / n:.3f} | "
                     f"{1e3 * d['host_s'] / n:.3f} |")
    lines += ["", "| decode bucket | steps | rows a step | context a row | forward ms a step | GB a step | GB/s |",
              "|---|---|---|---|---|---|---|"]
    for bucket, b in sorted(s["decode"]["by_bucket"].items()):
        n = max(b["steps"], 1)
        gb = (weight_bytes * b["steps"] + kv_bytes * b["tokens"]) / 1e9
        lines.append(f"| {bucket} | {b['steps']} | {b['rows'] / n:.1f} | {b['tokens'] / max(b['rows'], 1):.0f} | "
                     f"{1e3 * b['forward_s'] / n:.3f} | {gb / n:.3f} | {gb / max(b['forward_s'], 1e-12):.0f} |")
    return lines


def kernel_report(engine: RolloutEngine, params: SamplingParams, steps: int, trace: str | None) -> list[str]:
    """The kernels of `steps` replays of the largest bucket's decode graph, each with its sampler."""
    key = max(engine.graphs)   # (bucket, table width, packs)
    (bucket, width, _), graph = key, engine.graphs[key]
    counters = torch.zeros(bucket, 2, dtype=torch.long, device=graph.inputs.device)

    def one() -> None:
        graph(graph.inputs, graph.tables)
        draw(graph.logits, params, 0, counters)

    one()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return kernel_table(prof, steps, f"one decode step at bucket {bucket} (table width {width}), the sampler "
                                     "included", "a step")


def kernel_table(prof: Any, repeats: int, what: str, per: str) -> list[str]:
    """The profile's kernels (device time and launches per repeat), the longest first."""
    kernels: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and not e.key.startswith(("Memcpy", "Memset")):
            kernels[e.key] = [e.device_time_total / repeats, e.count / repeats]
    total = sum(t for t, _ in kernels.values())
    lines = ["", (f"kernels of {what}: {len(kernels)} kinds, {sum(c for _, c in kernels.values()):.0f} launches, "
             f"{total / 1e3:.3f} ms"), "", f"| kernel | µs {per} | launches {per} |", "|---|---|---|"]
    for name in sorted(kernels, key=lambda k: kernels[k][0], reverse=True)[:TOP_KERNELS]:
        lines.append(f"| `{name[:100]}` | {kernels[name][0]:.1f} | {kernels[name][1]:.0f} |")
    return lines


def prefill_report(engine: RolloutEngine, prompts: list[list[int]], rows: int, region: Any) -> list[str]:
    """The kernels and wall time of a call that only prefills (one new token) the first `rows` prompts."""
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    with region():
        engine.generate(prompts[:rows], params, seed=1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.generate(prompts[:rows], params, seed=1)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    tokens = sum(map(len, prompts[:rows]))
    return (kernel_table(prof, 1, f"a prefill-only call of {rows} prompts ({tokens} prompt tokens; wall "
                                  f"{1e3 * wall:.1f} ms under the profiler)", "in all") + host_table(prof))


def host_table(prof: Any) -> list[str]:
    """The profile's host operators by self CPU time (where a host-bound step spends it)."""
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in ops)
    lines = ["", f"host operators: {total / 1e3:.3f} ms of self CPU time in all", "",
             "| operator | self CPU µs | calls |", "|---|---|---|"]
    for e in sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:2 * TOP_KERNELS]:
        lines.append(f"| `{e.key[:100]}` | {e.self_cpu_time_total:.0f} | {e.count} |")
    return lines


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--lo", type=int, default=100)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=0, help="every prompt this long (0: U[lo, hi])")
    ap.add_argument("--new-tokens", type=int, default=0, help="every row this many new tokens (0: U[lo, hi])")
    ap.add_argument("--group", type=int, default=1, help="each prompt repeated this many times, as a GRPO group")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--admit-batch", type=int, default=None, help="rows joining at once (default: the schema's)")
    ap.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                    help="the KV pool's dtype (default: the schema's)")
    ap.add_argument("--mixed", action="store_true", help="float32 weights under bf16 autocast (fw fit's bf16-mixed)")
    ap.add_argument("--fresh", action="store_true",
                    help="time a call on a new engine, as a GRPO/PPO rollout whose engine is not kept is: its "
                         "pool allocated and its decode graphs captured inside the call")
    ap.add_argument("--kernels", type=int, default=0, help="profile this many decode-graph replays (CUDA)")
    ap.add_argument("--trace", default=None, help="where the --kernels profile's chrome trace goes")
    ap.add_argument("--prefill-kernels", type=int, default=0,
                    help="profile a call that only prefills this many of the prompts (CUDA)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = preset_config(args.preset, PRESETS[args.preset]["vocab_size"] or 256)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda and not args.mixed else torch.float32
    model = Qwen3ForCausalLM(cfg).to(dtype).to(device).eval()
    prompts, outs = prompts_and_lengths(args, cfg.vocab_size)
    base = CacheSettings.from_config(None)
    engine = RolloutEngine(model, CacheSettings(args.kv_cache_gib, base.max_num_seqs, base.block_size,
                                                args.admit_batch or base.admit_batch,
                                                args.kv_cache_dtype or base.kv_cache_dtype))
    params = SamplingParams(max_new_tokens=outs, temperature=args.temperature)

    def region():
        return torch.autocast(device, dtype=torch.bfloat16) if args.mixed else contextlib.nullcontext()

    with region():
        engine.generate(prompts, params, seed=0)
    if args.fresh:
        engine.release()
        engine = RolloutEngine(model, engine.settings)
    before = engine.preemptions
    engine.timeline = Timeline(torch.device(device))
    with region():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params, seed=0)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    summary = engine.timeline.summary()
    engine.timeline = None
    weight_bytes, kv_bytes = step_bytes(model, torch.bfloat16 if args.mixed else dtype, engine.cache.k.dtype)
    lines = [(f"{args.preset}, {'float32 weights under bf16 autocast' if args.mixed else str(dtype)}, "
             f"{len(prompts)} rows ({len(prompts) // args.group} prompts x {args.group}), "
             f"{sum(outs)} output tokens, KV cache {engine.settings.kv_cache_dtype} ({engine.cache.k.dtype}), "
             f"{'a fresh engine' if args.fresh else 'a warm engine'}")]
    lines += timeline_report(summary, wall, sum(outs), weight_bytes, kv_bytes)
    lines.append(f"\npeak rows {engine.peak_rows}, preemptions {engine.preemptions - before}, "
                 f"KV blocks {engine.cache.num_blocks}")
    if args.kernels and cuda:
        if engine.graphs:
            with region():
                lines += kernel_report(engine, params, args.kernels, args.trace)
        else:   # under autocast the graphs read casts that die with the call's autocast region
            lines.append("\nno decode graph is kept after a call under autocast: no kernel profile")
    if args.prefill_kernels and cuda:
        lines += prefill_report(engine, prompts, args.prefill_kernels, region)
    engine.release()
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
