"""Plain sampling (temperature 1, no top-k / top-p: the split kernel and the inverse-CDF draw) at V 151,936 with
bf16 logits: the share of rows whose token equals the float64 reference's draw at the same Philox uniform (a target
within float32 rounding of a column's edge may take its neighbour), the logprob's largest relative error, and fw's
time (CUDA-graph replay medians in us, three rounds), against torch.compile of softmax and `torch.multinomial` at
the last batch size.

    python -m benchmarks.ops.sample_plain 1,64,256      (needs a CUDA GPU)
"""
from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.ops.bench_ops import bench_graph, compiled, fw_sample, sample_torch
from ops_cuda import library
from ops_cuda.sample import sample_reference

V = 151936


def main(batches: list[int]) -> None:
    assert library.activate_cuda() == "kernels", library.cuda_state["error"]
    comp = compiled(sample_torch)
    for B in batches:
        lg = (3 * torch.randn(B, V, device="cuda")).to(torch.bfloat16)
        tok, lp = fw_sample(lg, 1.0, 0, 1.0)
        tok_ref, _ = sample_reference(lg.double(), 1.0, 0, 1.0, 0.0, 1)
        full = lg.double().log_softmax(-1).gather(1, tok[:, None]).squeeze(1)
        print(f"B={B}: tokens equal to the float64 reference draw {(tok == tok_ref).float().mean().item():.4f}, "
              f"max rel logprob err {((lp - full).abs() / full.abs()).max().item():.2e}", flush=True)
        fw_us, comp_us = [], []
        for _ in range(3):
            fw_us.append(bench_graph(lambda x=lg: fw_sample(x, 1.0, 0, 1.0), reps_ms=60)[0] * 1e3)
            if B == batches[-1]:
                comp(lg, 1.0, 0, 1.0)  # compile outside the graph capture
                comp_us.append(bench_graph(lambda x=lg: comp(x, 1.0, 0, 1.0), reps_ms=60)[0] * 1e3)
        line = f"B={B}: fw {' '.join(f'{t:.1f}' for t in fw_us)} us (median {statistics.median(fw_us):.1f})"
        if comp_us:
            ratio = statistics.median(comp_us) / statistics.median(fw_us)
            line += (f"; compile {' '.join(f'{t:.1f}' for t in comp_us)} (median {statistics.median(comp_us):.1f}, "
                     f"fw {ratio:.2f}x)")
        print(line, flush=True)


if __name__ == "__main__":
    main([int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,64,256").split(",")])
