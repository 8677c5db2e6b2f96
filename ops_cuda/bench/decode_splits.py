"""Decode attention time by split count (FW_DECODE_SPLITS, read per call), at Qwen3-0.6B heads (16 q, 8 kv,
head_dim 128) over batch x cache length, with every row full and with random lengths: the data behind
`decode_attention_splits` in ops_cuda/csrc/decode_attention.cu. "auto" is the built-in choice; "=n" marks
a forced count above the cap of ceil(S / 64), which runs as n splits.

    python -m ops_cuda.bench.decode_splits            (needs a CUDA GPU; CUDA-graph replay medians, us)
"""
from __future__ import annotations

import os

import torch

import ops_cuda
from ops_cuda import library
from ops_cuda.bench.bench_ops import bench_graph

SPLITS = ["", "1", "2", "3", "4", "6", "8", "12", "16", "32"]
SHAPES = [(1, 1024), (16, 1024), (64, 1024), (256, 1024), (64, 2048), (256, 2048), (256, 384)]


def times_us(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lengths: torch.Tensor) -> list[float]:
    """Median replay time of one decode_attention call for each entry of SPLITS."""
    out = []
    for splits in SPLITS:
        os.environ["FW_DECODE_SPLITS"] = splits
        ms, _ = bench_graph(lambda: ops_cuda.decode_attention(q, kc, vc, lengths, q.shape[-1] ** -0.5), reps_ms=60)
        out.append(ms * 1e3)
    os.environ.pop("FW_DECODE_SPLITS")
    return out


def main() -> None:
    assert library.activate_cuda() == "kernels", library.cuda_state["error"]
    hq, hk, d = 16, 8, 128
    gen = torch.Generator().manual_seed(0)
    print("B    S     lengths  " + "  ".join(f"{s or 'auto':>6}" for s in SPLITS))
    for b, s in SHAPES:
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        cases = [("full", torch.full((b,), s))]
        if b > 1:
            cases.append(("random", torch.randint(s // 10, s + 1, (b,), generator=gen)))
        for name, lengths in cases:
            times = times_us(q, kc, torch.randn_like(kc), lengths.cuda())
            most = min(-(-s // 64), 64)   # the kernel caps a forced count at ceil(S / 64) and 64
            cells = [f"{t:6.1f}" if not n or int(n) <= most else f"{'=' + str(most):>6}" for n, t in zip(SPLITS, times)]
            print(f"{b:<4} {s:<5} {name:<8} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
