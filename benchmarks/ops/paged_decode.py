"""Paged decode attention (`ops_cuda.paged_decode_attention`, one layer) over batch x context length, by KV pool
dtype and launch setting, against a device copy of the same K/V bytes (the floor a decode step's attention can
reach). Blocks are handed out in a shuffled order, as a long-running pool leaves them.

    python -m benchmarks.ops.paged_decode                                 Qwen3-0.6B heads, bf16 and fp8 pools
    python -m benchmarks.ops.paged_decode --shapes 128x1500 --columns FW_DECODE_PERSIST=0 FW_DECODE_PERSIST=1
    python -m benchmarks.ops.paged_decode --heads 32,8 --shapes 256x512    Qwen3-4B/8B heads
    python -m benchmarks.ops.paged_decode --shapes 256x372 --group 8 --prompt 116 --columns "" FW_DECODE_SHARED=0
    ncu --clock-control none -k regex:decode_mma --launch-count 1 python -m benchmarks.ops.paged_decode --once ...

Needs a CUDA GPU. Cells: CUDA-graph replay median in us, then the K/V bytes the lengths cover a second (GB/s);
the copy column moves the same bytes with one device-to-device copy. With --group G, rows come in groups of G whose
prompt's full blocks (the first --prompt positions, rounded down to blocks) are the same blocks of the pool, and the
op gets the packs that say so (column setting FW_DECODE_SHARED=0: no packs); the GB/s still count every row's
context, and the copy column moves the bytes the pool holds for them, each shared block once. --once runs each case
once, plainly, for a profiler.
"""
from __future__ import annotations

import argparse
import os

import torch

import ops_cuda
from benchmarks.ops.bench_ops import bench_graph
from ops_cuda import library

POOLS = {"auto": torch.bfloat16, "float8_e4m3": torch.float8_e4m3fn}


def settings(column: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in column.split()) if column else {}


def case(b: int, s: int, hq: int, hk: int, d: int, block: int, pool: torch.dtype, gen: torch.Generator,
         group: int = 1, prompt: int = 0):
    """Inputs of one call: every row `s` positions long, its blocks scattered over a pool with room to spare; rows in
    groups of `group` share their first prompt // block blocks. Returns the op's inputs, its packs, and the blocks
    the rows' contexts take in the pool."""
    per_row = -(-s // block)
    shared = min(prompt // block, per_row) if group > 1 else 0
    groups = -(-b // group)
    used = groups * shared + b * (per_row - shared)
    blocks = used + per_row
    order = torch.randperm(blocks, generator=gen)[:used]
    heads = order[:groups * shared].view(groups, shared)
    own = order[groups * shared:].view(b, per_row - shared)
    rows = torch.arange(b)
    tables = torch.cat([heads[rows // group], own], 1)
    first = rows // group * group
    packs = torch.stack([first, torch.clamp(b - first, max=group), torch.full((b,), shared * block)], 1)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(blocks, hk, block, d, device="cuda").to(pool)
    v = torch.randn(blocks, hk, block, d, device="cuda").to(pool)
    lengths = torch.full((b,), s, device="cuda", dtype=torch.int64)
    return (q, k, v, tables.cuda(), lengths, d ** -0.5), packs.cuda(), used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="128x1500,256x850,256x256,32x1500", help="BxS,... (rows x context length)")
    p.add_argument("--heads", default="16,8", help="query heads,kv heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pools", default="auto,float8_e4m3", help=f"pool dtypes among {','.join(POOLS)}")
    p.add_argument("--columns", nargs="+", default=[""], help="settings a column: NAME=VALUE ... ('' = default)")
    p.add_argument("--group", type=int, default=1, help="rows a group, sharing their prompt's full blocks")
    p.add_argument("--prompt", type=int, default=0, help="the group's prompt length (positions)")
    p.add_argument("--once", action="store_true", help="each case once, plainly (for a profiler)")
    args = p.parse_args()
    assert library.activate_cuda() == "kernels", library.cuda_state["error"]
    hq, hk = (int(x) for x in args.heads.split(","))
    gen = torch.Generator().manual_seed(0)
    for i, c in enumerate(args.columns):
        print(f"[{i}] {c or 'default'}")
    heads = "  ".join(f"{f'[{i}]':>12}" for i in range(len(args.columns)))
    print(f"pool         B    S     {heads}          copy")
    for shape in args.shapes.split(","):
        b, s = (int(x) for x in shape.split("x"))
        for name in args.pools.split(","):
            inputs, packs, used = case(b, s, hq, hk, args.head_dim, args.block_size, POOLS[name], gen, args.group,
                                       args.prompt)
            elem = inputs[1].element_size()
            kv_bytes = 2 * b * s * hk * args.head_dim * elem
            pool_bytes = 2 * used * args.block_size * hk * args.head_dim * elem if args.group > 1 else kv_bytes
            cells = []
            for column in args.columns:
                env = settings(column)
                os.environ.update(env)
                try:
                    with_packs = args.group > 1 and env.get("FW_DECODE_SHARED", "1") != "0"

                    def fn(i=inputs, pk=packs if with_packs else None):
                        return ops_cuda.paged_decode_attention(*i, pk)
                    if args.once:
                        fn()
                        torch.cuda.synchronize()
                        continue
                    ms, _ = bench_graph(fn, reps_ms=100)
                finally:
                    for key in env:
                        os.environ.pop(key, None)
                cells.append(f"{ms * 1e3:6.1f} {kv_bytes / ms * 1e-6:5.0f}")
            if args.once:
                continue
            src = torch.empty(pool_bytes, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            ms, _ = bench_graph(lambda d=dst, c=src: d.copy_(c), reps_ms=100)
            cells.append(f"{ms * 1e3:6.1f} {kv_bytes / ms * 1e-6:5.0f}")
            print(f"{name:<12} {b:<4} {s:<5} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
