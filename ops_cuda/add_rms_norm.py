"""add_rms_norm: a residual add and the RMSNorm of its result in one pass, for the inference forwards (the
rollout's decode and prefill): two kernels of a layer fewer. Schema, checks, torch reference, fake; no autograd.

CUDA kernel: csrc/add_rms_norm.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import define, fail, need_dim
from ops_cuda.rms_norm import rms_norm_reference


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(h, y): h = residual + x in residual's dtype, as torch adds them, and y = rms_norm(h) in `out_dtype`
    (None: h's), rounded once from the norm's float result as a cast of rms_norm's output would be."""
    h = residual + x
    y = rms_norm_reference(h, weight, eps)
    return h, y if out_dtype is None else y.to(out_dtype)


def _fake(x, residual, weight, eps, out_dtype=None):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape, dtype=out_dtype or residual.dtype)


define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, ScalarType? out_dtype=None) "
       "-> (Tensor, Tensor)", add_rms_norm_reference, fake=_fake)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """h = residual + x and rms_norm(h, weight, eps), for x and residual [..., D] of one shape, where x's dtype
    promotes to residual's (both bf16, or residual float32). `out_dtype` is the norm's output dtype (None: h's),
    e.g. the bf16 that the next matmul takes under autocast over a float32 residual stream, so that no cast
    kernel runs between. Inference only: no gradient."""
    need_dim("add_rms_norm", "weight", weight, 1, f"[D] with D = x.shape[-1] = {x.shape[-1]}")
    if x.shape != residual.shape or weight.shape[0] != x.shape[-1]:
        fail("add_rms_norm", f"shapes disagree: x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
                             f"{tuple(weight.shape)}")
    if torch.promote_types(x.dtype, residual.dtype) != residual.dtype:
        fail("add_rms_norm", f"x ({x.dtype}) must promote to residual's dtype ({residual.dtype})")
    if out_dtype not in (None, x.dtype, residual.dtype):
        fail("add_rms_norm", f"out_dtype must be x's ({x.dtype}) or residual's ({residual.dtype}), got {out_dtype}")
    return torch.ops.fw.add_rms_norm(x, residual, weight, float(eps), out_dtype)
