"""fw::shared_prompt_attention forward + backward on a GRPO micro-batch's layout (each group's prompt once, then its
completions), with cuDNN's attention for equal completions (the default) against the flash-only path
(FW_CUDNN_ATTENTION=0) in the same process, and SDPA over each completion laid out after its own copy of the
prompt (the padded layout's attention, torch's own backend choice) as the plain-torch baseline.

    python -m benchmarks.ops.shared_prompt                 # grpo-bench's micro-batch: 8 groups of 8 x 256 after 116
    python -m benchmarks.ops.shared_prompt --ragged        # completions of U[1, 256] tokens: flash serves

bf16, Qwen3-0.6B's 16 query and 8 key/value heads of 128. Wall ms: medians of --reps back-to-back calls (CUDA
events), one value a round, so a call whose host work outlasts its kernels shows its host time; device ms: its
kernels' time a call (torch.profiler, over --reps calls), what it costs inside a step whose host runs ahead of the
GPU. Peak memory over each mode's rounds. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics

import torch
import torch.nn.functional as F

import ops_cuda
from benchmarks.ops.varlen_backends import HK, HQ, D, time_ms


def device_ms(fn, reps: int) -> float:
    """The CUDA kernels' time of one call of fn, averaged over reps calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / reps / 1e3


def layout(groups: int, size: int, prompt: int, completion: int, ragged: bool, seed: int = 0):
    """q, k, v [T, H, D] of one packed row and the op's layout arguments."""
    g = torch.Generator().manual_seed(seed)
    lens = (torch.randint(1, completion + 1, (groups, size), generator=g) if ragged
            else torch.full((groups, size), completion)).tolist()
    seqs = [prompt] * groups + [c for row in lens for c in row]
    cu = [torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32, device="cuda")
          for x in ([prompt] * groups, [sum(r) for r in lens], seqs)]
    T = sum(seqs)
    qkv = [torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HK, HK)]
    return qkv, groups * prompt, cu, (prompt, max(sum(r) for r in lens), max(seqs)), lens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=116)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--ragged", action="store_true", help="completions of U[1, --completion] tokens")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    (q, k, v), n, cu, sizes, lens = layout(args.groups, args.group_size, args.prompt, args.completion, args.ragged)
    scale = D ** -0.5
    grad = torch.randn_like(q)

    def shared():
        ops_cuda.shared_prompt_attention(q, k, v, n, *cu, *sizes, scale).backward(grad)

    # the baseline: each completion after its own copy of its group's prompt, equal rows when the completions are
    rows = [args.prompt + c for row in lens for c in row]
    width = max(rows)
    qr, kr, vr = (torch.randn(len(rows), h, width, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for h in (HQ, HK, HK))
    gr = torch.randn_like(qr)

    def sdpa_rows():
        F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=True).backward(gr)

    modes = {"fw (cuDNN for equal completions)": ("1", shared), "fw flash only (FW_CUDNN_ATTENTION=0)": ("0", shared),
             "SDPA over whole rows (padded layout)": ("1", sdpa_rows)}
    outs = {}
    for name, (flag, _) in list(modes.items())[:2]:
        os.environ["FW_CUDNN_ATTENTION"] = flag
        for t in (q, k, v):
            t.grad = None
        shared()
        outs[name] = [t.grad.float().clone() for t in (q, k, v)]
    a, b = outs.values()
    diff = max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b, strict=True))
    T = q.shape[0]
    shape = f"U[1, {args.completion}] tokens" if args.ragged else f"{args.completion} tokens each"
    print(f"shared_prompt_attention fwd+bwd, {args.groups} groups x {args.group_size} completions ({shape}) after "
          f"{args.prompt}-token prompts: {T} tokens; the baseline's rows {len(rows)} x {width}; "
          f"{torch.cuda.get_device_name()}; gradients of the two fw paths differ by {diff:.2e} (relative)")
    # memory: the peak above what the mode's rounds start with (both layouts' inputs and gradients are held)
    print("| mode | wall ms (rounds) | median | device ms (rounds) | median | peak allocated above the start, GiB | "
          "peak reserved GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, (flag, fn) in modes.items():
        os.environ["FW_CUDNN_ATTENTION"] = flag
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        times, dev = [], []
        for _ in range(args.rounds):
            times.append(time_ms(fn, args.reps))
            dev.append(device_ms(fn, args.reps))
        above, reserved = (torch.cuda.max_memory_allocated() - start) / 2**30, torch.cuda.max_memory_reserved() / 2**30
        cells = [f"{', '.join(f'{t:.3f}' for t in x)} | {statistics.median(x):.3f}" for x in (times, dev)]
        print(f"| {name} | {' | '.join(cells)} | {above:.2f} | {reserved:.2f} |", flush=True)
    os.environ.pop("FW_CUDNN_ATTENTION")


if __name__ == "__main__":
    main()
