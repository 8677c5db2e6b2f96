"""Decode attention time by launch setting, at Qwen3-0.6B heads (16 q, 8 kv, head_dim 128; --heads) over batch x cache
length, with every row full and with random lengths: the data behind `decode_attention_plan` in
ops_cuda/csrc/decode_attention.cu. The overrides are read per call.

    python -m benchmarks.ops.decode_splits                      by split count (FW_DECODE_SPLITS)
    python -m benchmarks.ops.decode_splits --columns "FW_DECODE_SPLITS=" "FW_DECODE_SPLITS=2" --heads 32,8 \
        --shapes 256x1024,64x1024 --compile                    any settings, and torch.compile's SDPA as a baseline
    python -m benchmarks.ops.decode_splits --columns FW_DECODE_PERSIST=0 FW_DECODE_PERSIST=1 --gbps \
        --shapes 256x256,256x512,256x1024,64x1024,48x1024,8x1024,1x2048   the persistent kernel against the other

Needs a CUDA GPU; CUDA-graph replay medians, us (with --gbps also the K/V bytes the lengths cover a second, GB/s).
In the split sweep, "=n" marks a forced count above the cap of ceil(S / 64), which runs as n splits.
"""
from __future__ import annotations

import argparse
import os

import torch

import ops_cuda
from benchmarks.ops.bench_ops import bench_graph, compiled, decode_sdpa
from ops_cuda import library

SPLITS = ["", "1", "2", "3", "4", "6", "8", "12", "16", "32"]
SPLIT_COLUMNS = [f"FW_DECODE_SPLITS={s}" for s in SPLITS]
SHAPES = "1x1024,16x1024,64x1024,256x1024,64x2048,256x2048,256x384"


def settings(column: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in column.split())


def time_us(fn, column: str) -> float:
    """Median replay time of fn with the column's environment set (and removed afterwards)."""
    env = settings(column)
    os.environ.update(env)
    try:
        ms, _ = bench_graph(fn, reps_ms=60)
    finally:
        for k in env:
            os.environ.pop(k, None)
    return ms * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--columns", nargs="+", default=SPLIT_COLUMNS, help="settings a column: NAME=VALUE ...")
    p.add_argument("--shapes", default=SHAPES, help="BxS,... (batch x cache length)")
    p.add_argument("--heads", default="16,8", help="query heads,kv heads (head_dim 128)")
    p.add_argument("--compile", action="store_true", help="add torch.compile of the masked SDPA as a last column")
    p.add_argument("--gbps", action="store_true", help="each time with the K/V bytes read a second (GB/s)")
    args = p.parse_args()
    assert library.activate_cuda() == "kernels", library.cuda_state["error"]
    (hq, hk), d = (int(x) for x in args.heads.split(",")), 128
    gen = torch.Generator().manual_seed(0)
    split_sweep = args.columns == SPLIT_COLUMNS
    names = [s or "auto" for s in SPLITS] if split_sweep else [f"[{i}]" for i in range(len(args.columns))]
    if not split_sweep:
        for n, c in zip(names, args.columns):
            print(f"{n} {c}")
    sdpa = compiled(decode_sdpa) if args.compile else None
    width = 12 if args.gbps else 6   # "us GB/s" cells
    print("B    S     lengths  " + "  ".join(f"{n:>{width}}" for n in names) + ("  compile" if sdpa else ""))
    for shape in args.shapes.split(","):
        b, s = (int(x) for x in shape.split("x"))
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        cases = [("full", torch.full((b,), s))]
        if b > 1:
            cases.append(("random", torch.randint(s // 10, s + 1, (b,), generator=gen)))
        for name, lengths in cases:
            inputs = (q, kc, vc, lengths.cuda(), d ** -0.5)
            times = [time_us(lambda i=inputs: ops_cuda.decode_attention(*i), c) for c in args.columns]
            if split_sweep:
                most = min(-(-s // 64), 64)   # the kernel caps a forced count at ceil(S / 64) and 64
                cells = [f"{t:6.1f}" if not n or int(n) <= most else f"{'=' + str(most):>6}"
                         for n, t in zip(SPLITS, times)]
            elif args.gbps:
                kv_bytes = int(lengths.clamp(max=s).sum()) * hk * d * 2 * kc.element_size()   # K and V rows
                cells = [f"{t:6.1f} {kv_bytes / t * 1e-3:5.0f}" for t in times]
            else:
                cells = [f"{t:6.1f}" for t in times]
            if sdpa:
                ms, _ = bench_graph(lambda i=inputs: sdpa(*i), reps_ms=60)
                cells.append(f"{ms * 1e3:7.1f}")
            print(f"{b:<4} {s:<5} {name:<8} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
