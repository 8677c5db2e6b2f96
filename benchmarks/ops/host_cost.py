"""The host's cost of one call of each training-forward operator, on tensors so small that the device's work is
negligible: what a host-bound forward pays per op, beside the host probe (a one-element in-place add).

Each row calls the op in a loop and reports µs a call (median of --rounds runs of --calls). The "parts" rows split
`ops_cuda.add_rms_norm` into its reference's own work (called directly, CPU only), the dispatcher and the op
wrapper, and autograd's share (the same call with inputs that require gradients); the last row calls the op with
gradients through a plain `torch.autograd.Function` that saves what its `torch.library` autograd registration saves,
to price that registration's own Python (the forward only: no backward runs here).

    python -m benchmarks.ops.host_cost [--device cuda] [--calls 3000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import ops_cuda
from ops_cuda.add_rms_norm import _backward as add_rms_norm_backward
from ops_cuda.add_rms_norm import _setup as add_rms_norm_setup
from ops_cuda.library import REFERENCES


def per_call_us(f: Callable[[], object], calls: int, rounds: int, sync: Callable[[], None]) -> float:
    """Median over `rounds` of the µs a call of `f` takes, `calls` calls a round, after a warm-up."""
    for _ in range(100):
        f()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


class _PlainAddRmsNorm(torch.autograd.Function):
    """fw::add_rms_norm under a plain autograd.Function that runs its registration's own setup and backward, for
    the price of the registration's layers."""

    @staticmethod
    def forward(ctx, *inputs):
        out = torch.ops.fw.add_rms_norm(*inputs)
        add_rms_norm_setup(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_h, grad_y):
        return add_rms_norm_backward(ctx, grad_h, grad_y)


def cases(device: str) -> dict[str, Callable[[], object]]:
    """The ops of one training layer (and the host probe), on [4, ...] tensors; `grad` ones require gradients."""
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).requires_grad_(grad)

    x, h, w = t(4, 64, grad=True), t(4, 64, grad=True), torch.ones(64, device=device, requires_grad=True)
    xd, hd, wd = x.detach(), h.detach(), w.detach()
    gate_up = t(4, 128, grad=True)
    qkv = t(4, 4 * 64, grad=True)   # 2 query heads and 1 kv head of 64
    positions = torch.arange(4, device=device)
    qw, kw = torch.ones(64, device=device, requires_grad=True), torch.ones(64, device=device, requires_grad=True)
    linear = torch.nn.Linear(64, 64, bias=False, device=device)
    probe = torch.zeros(1, device=device)
    out = {
        "host probe: one-element add_": lambda: probe.add_(1),
        "nn.Linear, grad": lambda: linear(x),
        "rms_norm, grad": lambda: ops_cuda.rms_norm(x, w, 1e-6),
        "add_rms_norm, grad": lambda: ops_cuda.add_rms_norm(x, h, w, 1e-6),
        "qk_norm_rope, grad": lambda: ops_cuda.qk_norm_rope(qkv, positions, qw, kw, 1e-6, 1e4, 1),
        "swiglu, grad": lambda: ops_cuda.swiglu(gate_up),
        "parts: add_rms_norm, no grad": lambda: ops_cuda.add_rms_norm(xd, hd, wd, 1e-6),
        "parts: torch.ops.fw.add_rms_norm, no grad": lambda: torch.ops.fw.add_rms_norm(xd, hd, wd, 1e-6, None),
        "parts: torch.ops.fw.add_rms_norm, grad": lambda: torch.ops.fw.add_rms_norm(x, h, w, 1e-6, None),
        "parts: the op, grad, under a plain autograd.Function": lambda: _PlainAddRmsNorm.apply(x, h, w, 1e-6, None),
    }
    if device == "cpu":
        ref = REFERENCES["add_rms_norm"]
        out["parts: its reference called directly"] = lambda: ref(xd, hd, wd, 1e-6, None)
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results = {name: per_call_us(f, args.calls, args.rounds, sync) for name, f in cases(args.device).items()}
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"host cost a call on {args.device} ({where}), µs, median of {args.rounds} rounds of {args.calls} calls")
    print("| op | µs a call |\n|---|---|")
    for name, us in results.items():
        print(f"| {name} | {us:.1f} |")
    return results


if __name__ == "__main__":
    main()
