"""Per-kernel GPU times of one fw op call (forward, or forward + backward), from torch.profiler's CUDA activity:
which launches an op makes and where its time goes, at the benchmark's Qwen3-0.6B shapes.

    python -m benchmarks.ops.profile_ops rms_norm qk_norm swiglu linear_logprob     (needs a CUDA GPU)
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import ops_cuda
from ops_cuda import library

DEV, BF = "cuda", torch.bfloat16


def cases(n_tokens: int) -> dict:
    """name -> a closure running the op forward and backward once."""
    def fwd_bwd(fn, inputs, grad):
        def run():
            out = fn(*inputs)
            torch.autograd.grad(out, [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad], grad)
        return run

    def t(*shape, grad=True, dtype=BF):
        return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)

    x, xq, w, wq = t(n_tokens, 1024), t(n_tokens, 16, 128), t(1024), t(128)
    gu = t(n_tokens, 6144)
    h, lm = t(n_tokens, 1024), (torch.randn(151936, 1024, device=DEV) / 32).to(BF).requires_grad_(True)
    tg = torch.randint(0, 151936, (n_tokens,), device=DEV)
    return {
        "rms_norm": fwd_bwd(lambda a, b: ops_cuda.rms_norm(a, b, 1e-6), (x, w), torch.randn_like(x)),
        "qk_norm": fwd_bwd(lambda a, b: ops_cuda.rms_norm(a, b, 1e-6), (xq, wq), torch.randn_like(xq)),
        "swiglu": fwd_bwd(ops_cuda.swiglu, (gu,), torch.randn(n_tokens, 3072, device=DEV, dtype=BF)),
        "linear_logprob": fwd_bwd(lambda a, b: ops_cuda.linear_logprob(a, b, tg, 1.0, save_logits=True)[0], (h, lm),
                                  torch.randn(n_tokens, device=DEV)),
        "linear_logprob_recomp": fwd_bwd(lambda a, b: ops_cuda.linear_logprob(a, b, tg, 1.0)[0], (h, lm),
                                         torch.randn(n_tokens, device=DEV)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ops", nargs="+")
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    assert library.activate_cuda() == "kernels", library.cuda_state["error"]
    runs = cases(args.tokens)
    for name in args.ops:
        run = runs[name]
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                run()
            torch.cuda.synchronize()
        per_kernel: dict[str, list[float]] = defaultdict(list)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[e.name].append(e.device_time_total)
        total = sum(sum(v) for v in per_kernel.values()) / args.reps
        print(f"\n{name}: {total:.1f} us of kernels per call ({args.reps} calls)")
        for k, v in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {sum(v) / args.reps:9.1f} us  x{len(v) / args.reps:4.1f}  {k[:110]}")


if __name__ == "__main__":
    main()
