"""rope (NeoX split-half rotary embedding; its backward is the inverse rotation): schema, argument checks,
torch reference, fake, autograd. CUDA kernel: csrc/rope.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_device, need_dim, need_float, need_long


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """float32 inverse frequencies, computed as transformers' Qwen3 rotary embedding does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, D/2] in float32; the angle is the float32 product position * inv_freq (as in HF)."""
    angle = positions.to(torch.float32)[..., None] * rope_inv_freq(head_dim, theta).to(positions.device)
    return angle.cos(), angle.sin()


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D] rotated by the angles whose cos, sin [B, T, D/2] are given, in x's accumulation dtype."""
    acc = acc_dtype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    c, s = cos[:, :, None, :].to(acc), sin[:, :, None, :].to(acc)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_reference(q: Tensor, k: Tensor, positions: Tensor, theta: float,
                   inverse: bool = False) -> tuple[Tensor, Tensor]:
    """NeoX split-half rotary embedding of q [B,T,Hq,D] and k [B,T,Hk,D]; `inverse` rotates by -angle
    (the backward: the rotation is orthogonal, so its gradient is the inverse rotation)."""
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
    if inverse:
        sin = -sin
    return rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)


define("rope(Tensor q, Tensor k, Tensor positions, float theta, bool inverse=False) -> (Tensor, Tensor)",
       rope_reference,
       fake=lambda q, k, positions, theta, inverse=False: (q.new_empty(q.shape), k.new_empty(k.shape)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.theta, ctx.inverse = inputs[3], inputs[4] if len(inputs) > 4 else False


def _backward(ctx, grad_q, grad_k):
    (positions,) = ctx.saved_tensors
    gq, gk = torch.ops.fw.rope(grad_q, grad_k, positions, ctx.theta, not ctx.inverse)
    return gq, gk, None, None, None


torch.library.register_autograd("fw::rope", _backward, setup_context=_setup)


def rope(q: Tensor, k: Tensor, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """NeoX split-half RoPE of q [B, T, Hq, D] and k [B, T, Hk, D] at positions [B, T]."""
    need_dim("rope", "q", q, 4, "[B, T, Hq, D]")
    need_dim("rope", "k", k, 4, "[B, T, Hk, D]")
    need_dim("rope", "positions", positions, 2, "[B, T]")
    need_long("rope", "positions", positions)
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or tuple(positions.shape) != tuple(q.shape[:2]):
        fail("rope", f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                     f"{tuple(positions.shape)} (expected q [B,T,Hq,D], k [B,T,Hk,D], positions [B,T])")
    if q.shape[3] % 2:
        fail("rope", f"head_dim must be even, got {q.shape[3]}")
    need_float("rope", q=q, k=k)
    need_device("rope", "q", q, k=k, positions=positions)
    return torch.ops.fw.rope(q, k, positions, float(theta))
