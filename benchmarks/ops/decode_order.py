"""Paged decode attention (`ops_cuda.paged_decode_attention`, one layer) on rows of unequal contexts, by the order of
the rows in the batch: as drawn, longest context first (the rollout engine's order on CUDA), shortest first. Each
row's context length is drawn from U[--lo, --hi], its blocks scattered over a bf16 pool; the copy column moves the
same K/V bytes with one device-to-device copy (reading and writing them).

    python -m benchmarks.ops.decode_order                       Qwen3-0.6B heads, U[100, 1800], B 24 to 256
    python -m benchmarks.ops.decode_order --columns "" FW_DECODE_SPLITS=2 FW_DECODE_PERSIST=1

Needs a CUDA GPU. Cells: CUDA-graph replay median in us, then the K/V bytes the lengths cover a second (GB/s).
"""
from __future__ import annotations

import argparse
import os

import torch

import ops_cuda
from benchmarks.ops.bench_ops import bench_graph
from benchmarks.ops.paged_decode import settings
from ops_cuda import library

ORDERS = ("drawn", "longest", "shortest")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="24,32,39,48,64,96,128,192,256", help="batch sizes")
    p.add_argument("--lo", type=int, default=100, help="shortest context")
    p.add_argument("--hi", type=int, default=1800, help="longest context")
    p.add_argument("--heads", default="16,8", help="query heads,kv heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--columns", nargs="+", default=[""], help="settings a column: NAME=VALUE ... ('' = default)")
    args = p.parse_args()
    assert library.activate_cuda() == "kernels", library.cuda_state["error"]
    hq, hk = (int(x) for x in args.heads.split(","))
    d, bs = args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    for i, c in enumerate(args.columns):
        print(f"[{i}] {c or 'default'}")
    heads = "  ".join(f"{f'[{i}]':>12}" for i in range(len(args.columns)))
    print(f"B    order     {heads}          copy")
    for b in (int(x) for x in args.rows.split(",")):
        lengths = torch.randint(args.lo, args.hi + 1, (b,), generator=gen)
        per_row = -(-lengths // bs)
        used, width = int(per_row.sum()), int(per_row.max())
        order = torch.randperm(used + width, generator=gen)
        tables = torch.zeros(b, width, dtype=torch.int64)
        start = 0
        for r, n in enumerate(per_row.tolist()):
            tables[r, :n] = order[start:start + n]
            start += n
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(used + width, hk, bs, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * int(lengths.sum()) * hk * d * k.element_size()
        src = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms, _ = bench_graph(lambda dst=dst, src=src: dst.copy_(src), reps_ms=100)
        for name in ORDERS:
            rows = torch.arange(b) if name == "drawn" else torch.argsort(lengths, descending=name == "longest")
            t, n = tables[rows].cuda(), lengths[rows].cuda()
            cells = []
            for column in args.columns:
                env = settings(column)
                os.environ.update(env)
                try:
                    def fn(i=(q, k, v, t, n, d ** -0.5)):
                        return ops_cuda.paged_decode_attention(*i)
                    ms, _ = bench_graph(fn, reps_ms=100)
                finally:
                    for key in env:
                        os.environ.pop(key, None)
                cells.append(f"{ms * 1e3:6.1f} {kv_bytes / ms * 1e-6:5.0f}")
            cells.append(f"{copy_ms * 1e3:6.1f} {kv_bytes / copy_ms * 1e-6:5.0f}")
            print(f"{b:<4} {name:<9} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
