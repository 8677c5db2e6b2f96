"""add_rms_norm: a residual add and the RMSNorm of its result in one pass, and its backward: the model's forwards
(training and the rollout's decode and prefill) run each residual add with the norm after it. Schemas, checks,
torch references, fakes, autograd.

CUDA kernel: csrc/add_rms_norm.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import define, fail, need_dim, need_float
from ops_cuda.rms_norm import rms_norm, rms_norm_backward_reference, rms_norm_reference

# The longest row the CUDA kernel takes (kThreads * kMaxPerThread in csrc/add_rms_norm.cu); longer ones (Qwen3-14B's
# and -32B's hidden size of 5120) run as an add and rms_norm.
KERNEL_MAX_D = 4096


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(h, y): h = residual + x in residual's dtype, as torch adds them, and y = rms_norm(h) in `out_dtype`
    (None: h's), rounded once from the norm's float result as a cast of rms_norm's output would be."""
    h = residual + x
    y = rms_norm_reference(h, weight, eps)
    return h, y if out_dtype is None else y.to(out_dtype)


def _fake(x, residual, weight, eps, out_dtype=None):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape, dtype=out_dtype or residual.dtype)


def add_rms_norm_backward_reference(grad_h: Tensor, grad_y: Tensor, h: Tensor, weight: Tensor, eps: float,
                                    x_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_residual, grad_weight): grad_residual = grad_h + the norm's gradient from grad_y, computed in
    float32 (float64 for float64) and rounded once to the residual's dtype, and to x's for grad_x."""
    gx, gw = rms_norm_backward_reference(grad_y.to(torch.promote_types(h.dtype, torch.float32)),
                                         h.to(torch.promote_types(h.dtype, torch.float32)), weight, eps)
    total = grad_h.to(gx.dtype) + gx
    return total.to(x_dtype, copy=True), total.to(h.dtype), gw


def _fake_backward(grad_h, grad_y, h, weight, eps, x_dtype):
    return h.new_empty(h.shape, dtype=x_dtype), h.new_empty(h.shape), weight.new_empty(weight.shape)


define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, ScalarType? out_dtype=None) "
       "-> (Tensor, Tensor)", add_rms_norm_reference, fake=_fake)
define("add_rms_norm_backward(Tensor grad_h, Tensor grad_y, Tensor h, Tensor weight, float eps, ScalarType x_dtype) "
       "-> (Tensor, Tensor, Tensor)", add_rms_norm_backward_reference, fake=_fake_backward)


def _setup(ctx, inputs, output):
    x, _, weight, eps, _ = inputs
    ctx.save_for_backward(output[0], weight)
    ctx.eps, ctx.x_dtype = eps, x.dtype


def _backward(ctx, grad_h, grad_y):
    h, weight = ctx.saved_tensors
    if grad_h is None:
        grad_h = torch.zeros_like(h)
    if grad_y is None:   # the norm's output unused: only the add's gradient
        return grad_h.to(ctx.x_dtype), grad_h, torch.zeros_like(weight), None, None
    gx, gr, gw = torch.ops.fw.add_rms_norm_backward(grad_h, grad_y, h, weight, ctx.eps, ctx.x_dtype)
    return gx, gr, gw, None, None


torch.library.register_autograd("fw::add_rms_norm", _backward, setup_context=_setup)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """h = residual + x and rms_norm(h, weight, eps), for x and residual [..., D] of one shape, where x's dtype
    promotes to residual's (both bf16, or residual float32). `out_dtype` is the norm's output dtype (None: h's),
    e.g. the bf16 that the next matmul takes under autocast over a float32 residual stream, so that no cast
    kernel runs between. Differentiable in x, residual and weight."""
    need_dim("add_rms_norm", "weight", weight, 1, f"[D] with D = x.shape[-1] = {x.shape[-1]}")
    if x.shape != residual.shape or weight.shape[0] != x.shape[-1]:
        fail("add_rms_norm", f"shapes disagree: x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
                             f"{tuple(weight.shape)}")
    need_float("add_rms_norm", x=x, residual=residual, weight=weight)
    if torch.promote_types(x.dtype, residual.dtype) != residual.dtype:
        fail("add_rms_norm", f"x ({x.dtype}) must promote to residual's dtype ({residual.dtype})")
    if out_dtype not in (None, x.dtype, residual.dtype):
        fail("add_rms_norm", f"out_dtype must be x's ({x.dtype}) or residual's ({residual.dtype}), got {out_dtype}")
    if weight.dtype not in (x.dtype, torch.float32):
        # the CUDA kernel reads the weight in x's dtype or float32: others (a bf16 weight under fp16 activations)
        # go as float32, differentiably, which holds a 16-bit weight exactly, as qk_norm_rope's kernel_weights does
        weight = weight.float()
    if x.is_cuda and x.shape[-1] > KERNEL_MAX_D:
        h = residual + x
        y = rms_norm(h, weight, eps)
        return h, y if out_dtype in (None, h.dtype) else y.to(out_dtype)
    return torch.ops.fw.add_rms_norm(x, residual, weight, float(eps), out_dtype)
