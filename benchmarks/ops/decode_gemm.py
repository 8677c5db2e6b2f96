"""The decode step's projections at a rollout's batch sizes: how close cuBLAS comes to reading the weights once.

A decode GEMM's output has few tiles (256 x 1024 is 16 tiles of 128 x 128 on 132 SMs), so most SMs could idle
unless the K loop is split. Per preset and projection this times `F.linear` (what the model runs) against
splitting K by hand into s batched GEMMs whose partial products are summed (`split_k_linear`), each as CUDA-graph
replays, with the weights' bytes read per second and its share of --gbps. Whether the weights' bytes bound the
GEMM depends on M: 2 * M FLOP per 2-byte weight against the GPU's FLOP per byte of bandwidth. Up to 64 rows it
also times `ops_cuda.skinny_linear` (K split over a thread block cluster; `FW_SKINNY_SPLITS` overrides the split
count).

    python -m benchmarks.ops.decode_gemm [--presets qwen3-0.6b,qwen3-4b,qwen3-8b] [--rows 64,256] [--splits 2,3,4]
        [--projections qkv,o,gate_up,down,lm_head]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor

import ops_cuda
from framework.models.presets import PRESETS
from ops_cuda.skinny_linear import MAX_ROWS


def projections(preset: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of a layer's four projections and of the LM head."""
    p = PRESETS[preset]
    d, heads, kv, hd, ffn = (p["hidden_size"], p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"],
                             p["intermediate_size"])
    return {"qkv": (d, (heads + 2 * kv) * hd), "o": (heads * hd, d), "gate_up": (d, 2 * ffn),
            "down": (ffn, d), "lm_head": (d, p["vocab_size"])}


def split_k_linear(x: Tensor, w: Tensor, splits: int) -> Tensor:
    """x [M, K] @ w[N, K]^T as `splits` GEMMs over slices of K in one batched call, then their sum (float32
    partials): more thread blocks for an output with few tiles."""
    M, K = x.shape
    k = K // splits
    xs = x[:, : k * splits].reshape(M, splits, k).transpose(0, 1)       # [s, M, k]
    ws = w[:, : k * splits].reshape(w.shape[0], splits, k).permute(1, 2, 0)   # [s, k, N]
    try:   # float32 partials where this torch's bmm writes them, else the GEMMs' own dtype
        out = torch.bmm(xs, ws, out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        out = torch.bmm(xs, ws).float()
    out = out.sum(0)
    if k * splits < K:   # the remainder of K
        out += F.linear(x[:, k * splits:], w[:, k * splits:]).float()
    return out.to(x.dtype)


def row(w: Tensor, M: int, splits: list[int], gbps: float) -> list[str]:
    """The table cells of one projection at M rows: F.linear's time (GB/s of weights, % of gbps), each split's,
    and the largest error of the splits and of F.linear against float64, relative to the output's largest value."""
    from benchmarks.ops.bench_ops import bench_graph

    x = torch.randn(M, w.shape[1], device=w.device, dtype=w.dtype)
    ref = x.double() @ w.double().T

    def err(y: Tensor) -> float:
        return float((y.double() - ref).abs().max() / ref.abs().max())

    base_ms, graphed = bench_graph(lambda: F.linear(x, w), reps_ms=50)
    def timed(ms: float, graphed: bool) -> str:
        rate = w.numel() * w.element_size() / (ms * 1e-3) / 1e9
        return f"{ms * 1e3:.1f} ({rate:.0f}, {100 * rate / gbps:.0f}%)" + ("" if graphed else " (no graph)")

    cells = [timed(base_ms, graphed)]
    skinny = M <= MAX_ROWS and w.shape[0] % 64 == 0 and w.shape[1] % 64 == 0
    cells.append(timed(*bench_graph(lambda: ops_cuda.skinny_linear(x, w), reps_ms=50)) if skinny else "-")
    for s in splits:
        ms, graphed = bench_graph(lambda s=s: split_k_linear(x, w, s), reps_ms=50)
        cells.append(f"{ms * 1e3:.1f}" + ("" if graphed else " (no graph)"))
    worst = max((err(split_k_linear(x, w, s)) for s in splits), default=float("nan"))
    others = f"F.linear {err(F.linear(x, w)):.1e}" + (f", skinny {err(ops_cuda.skinny_linear(x, w)):.1e}" if skinny
                                                       else "")
    return [*cells, f"{worst:.1e} ({others})"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--splits", default="2,3,4", help="hand splits of K to time; empty for none")
    ap.add_argument("--projections", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--gbps", type=float, default=4260.0, help="the GPU's measured copy bandwidth, GB/s")
    args = ap.parse_args()
    splits = [int(s) for s in args.splits.split(",") if s]
    only = args.projections.split(",")
    known = list(projections(args.presets.split(",")[0]))
    if set(only) - set(known):
        ap.error(f"--projections: unknown {sorted(set(only) - set(known))}; choose from {','.join(known)}")
    print("| preset | projection | M x K x N | F.linear us (GB/s, %) | skinny_linear us (GB/s, %) | "
          + " | ".join(f"split {s} us" for s in splits) + " | max rel. diff of the splits |")
    print("|---|---|---|---|---|" + "---|" * len(splits) + "---|")
    torch.manual_seed(0)
    for preset in args.presets.split(","):
        for name, (K, N) in projections(preset).items():
            if name not in only:
                continue
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
            for M in (int(m) for m in args.rows.split(",")):
                print(f"| {preset} | {name} | {M} x {K} x {N} | " + " | ".join(row(w, M, splits, args.gbps)) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
