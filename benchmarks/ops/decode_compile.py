"""A decode step's layers without their attention: fw's operators against the same maths compiled by Inductor.

Per layer at M rows: the QKV projection, fw's QK-norm with RoPE (both sides call it), the output projection (of q,
standing in for the attention's output), the residual add with the norm after it, gate_up, SwiGLU, down and the
second add and norm; bf16 weights of the preset, a float32 residual stream, as the rollout engine runs them. fw's
side calls ops_cuda.linear, add_rms_norm and swiglu; the compiled side is plain torch (F.linear, the norm's and
SwiGLU's formulas) under torch.compile, whose fusions (the norm into the add, SwiGLU, epilogues of its own GEMM
templates under max-autotune) are what it could gain. Each side runs all the layers in one CUDA graph, as a
decode step's graph replays them; the time is the median of three rounds of replays.

    python -m benchmarks.ops.decode_compile [--preset qwen3-0.6b] [--rows 256,64]
        [--modes fw,default,max-autotune-no-cudagraphs]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import ops_cuda
from framework.models.presets import PRESETS

EPS, THETA = 1e-6, 1e6


def layer_weights(preset: str) -> tuple[dict, list[dict[str, Tensor]]]:
    """The preset's shape and random bf16 weights of its layers (unit norm gains)."""
    p = PRESETS[preset]
    d, hq, hk, hd, ffn = (p["hidden_size"], p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"],
                          p["intermediate_size"])
    shape = {"d": d, "hq": hq, "hk": hk, "hd": hd, "ffn": ffn}

    def w(n: int, k: int) -> Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    ones = functools.partial(torch.ones, device="cuda")
    layers = [{"qkv": w((hq + 2 * hk) * hd, d), "o": w(d, hq * hd), "gate_up": w(2 * ffn, d), "down": w(d, ffn),
               "norm1": ones(d), "norm2": ones(d), "q_norm": ones(hd), "k_norm": ones(hd)}
              for _ in range(p["num_hidden_layers"])]
    return shape, layers


def fw_layers(shape: dict, layers: list[dict[str, Tensor]], h: Tensor, x: Tensor, pos: Tensor) -> Tensor:
    for w in layers:
        q, _, _ = ops_cuda.qk_norm_rope(ops_cuda.linear(x, w["qkv"]), pos, w["q_norm"], w["k_norm"], EPS, THETA,
                                        shape["hk"])
        h, x = ops_cuda.add_rms_norm(ops_cuda.linear(q.flatten(1), w["o"]), h, w["norm1"], EPS, torch.bfloat16)
        a = ops_cuda.swiglu(ops_cuda.linear(x, w["gate_up"]))
        h, x = ops_cuda.add_rms_norm(ops_cuda.linear(a, w["down"]), h, w["norm2"], EPS, torch.bfloat16)
    return h


def _rms(h: Tensor, weight: Tensor) -> Tensor:
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight).to(torch.bfloat16)


def torch_layers(shape: dict, layers: list[dict[str, Tensor]], h: Tensor, x: Tensor, pos: Tensor) -> Tensor:
    ffn = shape["ffn"]
    for w in layers:
        q, _, _ = ops_cuda.qk_norm_rope(F.linear(x, w["qkv"]), pos, w["q_norm"], w["k_norm"], EPS, THETA, shape["hk"])
        h = h + F.linear(q.flatten(1), w["o"])
        x = _rms(h, w["norm1"])
        gate_up = F.linear(x, w["gate_up"])
        h = h + F.linear(F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:], w["down"])
        x = _rms(h, w["norm2"])
    return h


def graphed_ms(fn: Callable[..., Tensor], args: tuple, rounds: int = 3, replays: int = 100
               ) -> tuple[float, list[float], Tensor]:
    """(median ms of a replay over `rounds` rounds, each round's, the output) of fn(*args) captured in a CUDA graph
    after warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times), times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--modes", default="fw,default,max-autotune-no-cudagraphs",
                    help="fw, eager (the plain torch maths) or a torch.compile mode without CUDA graphs of its own")
    args = ap.parse_args()
    # these modes capture CUDA graphs themselves, which cannot happen inside the capture that times each side
    for mode in {"reduce-overhead", "max-autotune"} & set(args.modes.split(",")):
        ap.error(f"--modes: {mode} captures its own CUDA graphs; use default or max-autotune-no-cudagraphs")
    torch.manual_seed(0)
    shape, layers = layer_weights(args.preset)
    print(f"| mode | M | µs a step of {len(layers)} layers | µs a layer | rounds | max abs. diff of h from fw's | "
          "wall s (compile, capture, timing) |")
    print("|---|---|---|---|---|---|---|")
    for M in (int(m) for m in args.rows.split(",")):
        h = torch.randn(M, shape["d"], device="cuda")
        x = torch.randn(M, shape["d"], device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(M, device="cuda") + 300
        reference = fw_layers(shape, layers, h, x, pos)
        for mode in args.modes.split(","):
            start = time.perf_counter()
            if mode == "fw":
                fn = fw_layers
            elif mode == "eager":
                fn = torch_layers
            else:
                torch._dynamo.reset()
                fn = torch.compile(torch_layers, mode=mode, fullgraph=True, dynamic=False)
            ms, times, out = graphed_ms(fn, (shape, layers, h, x, pos))
            diff = float((out - reference).abs().max())
            print(f"| {mode} | {M} | {ms * 1e3:.1f} | {ms * 1e3 / len(layers):.1f} | "
                  f"{', '.join(f'{t * 1e3:.1f}' for t in times)} | {diff:.2e} | {time.perf_counter() - start:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
