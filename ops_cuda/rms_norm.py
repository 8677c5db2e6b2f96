"""rms_norm and its backward: schemas, argument checks, torch references, fakes, autograd.

CUDA kernels: csrc/rms_norm.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_device, need_dim, need_float


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(acc)).to(x.dtype)


def rms_norm_backward_reference(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(x.dtype)
    xf, gf, wf = x.to(acc), grad.to(acc), weight.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gw = gf * wf
    # d/dx of x*rstd: rstd*g - x*rstd^3*mean(g*x)
    gx = rstd * gw - xf * rstd.pow(3) * (gw * xf).mean(-1, keepdim=True)
    gweight = (gf * xf * rstd).reshape(-1, x.shape[-1]).sum(0)
    return gx.to(x.dtype), gweight.to(weight.dtype)


define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm_reference,
       fake=lambda x, weight, eps: x.new_empty(x.shape))
define("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
       rms_norm_backward_reference,
       fake=lambda grad, x, weight, eps: (x.new_empty(x.shape), weight.new_empty(weight.shape)))


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = torch.ops.fw.rms_norm_backward(grad, x, weight, ctx.eps)
    return gx, gw, None


torch.library.register_autograd("fw::rms_norm", _backward, setup_context=_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with fp32 accumulation; returns x's dtype."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        fail("rms_norm", "`x` must be a tensor [..., D]")
    need_dim("rms_norm", "weight", weight, 1, f"[D] with D = x.shape[-1] = {x.shape[-1]}")
    if weight.shape[0] != x.shape[-1]:
        fail("rms_norm", f"`weight` has {weight.shape[0]} elements, expected x.shape[-1] = {x.shape[-1]}")
    need_float("rms_norm", x=x, weight=weight)
    need_device("rms_norm", "x", x, weight=weight)
    return torch.ops.fw.rms_norm(x, weight, float(eps))
