"""qk_norm_rope: Qwen3's QK-norm and RoPE read straight from the fused qkv projection's output, for training. Schemas,
checks, torch references, fakes, autograd.

From qkv [N, (Hq + 2 Hk) D], q and k are RMS-normalised per head (their norm weights), rounded to qkv's dtype as
rms_norm returns them, then rotated (NeoX split-half RoPE at the tokens' positions); v is returned as a copy. One
kernel replaces the strided q/k copies, two norms and a rotation; its backward writes d(qkv) in one buffer, v's part
included, where autograd would otherwise cat the gradients of the split. CUDA kernels: csrc/qk_norm_rope.cu, which
also serves qk_norm_rope_write.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_dim, need_float, need_long
from ops_cuda.rms_norm import rms_norm, rms_norm_backward_reference, rms_norm_reference
from ops_cuda.rope import rope, rope_cos_sin, rope_reference, rope_rotate

# The head sizes the CUDA kernels take; others run rms_norm and rope on views of qkv.
KERNEL_HEAD_DIMS = (64, 128, 256)


def _shapes(qkv: Tensor, head_dim: int, num_kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of q [N, Hq, D], k and v [N, Hk, D] for qkv [N, (Hq + 2 Hk) D]."""
    N, Hq = qkv.shape[0], qkv.shape[1] // head_dim - 2 * num_kv_heads
    return (N, Hq, head_dim), (N, num_kv_heads, head_dim), (N, num_kv_heads, head_dim)


def _heads(qkv: Tensor, head_dim: int, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q [N, Hq, D], k and v [N, Hk, D] of qkv [N, (Hq + 2 Hk) D]: views where qkv's rows allow."""
    (N, Hq, _), _, _ = _shapes(qkv, head_dim, num_kv_heads)
    return qkv.reshape(N, Hq + 2 * num_kv_heads, head_dim).split([Hq, num_kv_heads, num_kv_heads], dim=1)


def qk_norm_rope_reference(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                           theta: float, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = _heads(qkv, q_weight.shape[0], num_kv_heads)
    q, k = rope_reference(rms_norm_reference(q, q_weight, eps)[None], rms_norm_reference(k, k_weight, eps)[None],
                          positions[None], theta)
    # views of rope's [1, N, H, D] outputs and of qkv: the library copies each into a storage of its own, as the
    # kernel allocates its outputs
    return q[0], k[0], v


def qk_norm_rope_backward_reference(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qkv: Tensor, positions: Tensor,
                                    q_weight: Tensor, k_weight: Tensor, eps: float,
                                    theta: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_qkv, grad_q_weight, grad_k_weight): the gradients rotated back and through the norm in float32 (float64
    for float64), rounded once to qkv's dtype."""
    N, D, Hk = qkv.shape[0], q_weight.shape[0], grad_k.shape[1]
    q, k, _ = _heads(qkv, D, Hk)
    acc = acc_dtype(qkv.dtype)
    cos, sin = rope_cos_sin(positions[None], D, theta)
    gq = rope_rotate(grad_q.to(acc)[None], cos, -sin)[0]   # the rotation's transpose is its inverse
    gk = rope_rotate(grad_k.to(acc)[None], cos, -sin)[0]
    gxq, gwq = rms_norm_backward_reference(gq, q, q_weight, eps)
    gxk, gwk = rms_norm_backward_reference(gk, k, k_weight, eps)
    grad_qkv = torch.cat([gxq.reshape(N, -1), gxk.reshape(N, -1), grad_v.reshape(N, -1).to(qkv.dtype)], dim=1)
    return grad_qkv, gwq, gwk


def _fake(qkv, positions, q_weight, k_weight, eps, theta, num_kv_heads):
    return tuple(qkv.new_empty(shape) for shape in _shapes(qkv, q_weight.shape[0], num_kv_heads))


def _fake_backward(grad_q, grad_k, grad_v, qkv, positions, q_weight, k_weight, eps, theta):
    return qkv.new_empty(qkv.shape), q_weight.new_empty(q_weight.shape), k_weight.new_empty(k_weight.shape)


define("qk_norm_rope(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, float eps, float theta, "
       "int num_kv_heads) -> (Tensor, Tensor, Tensor)", qk_norm_rope_reference, fake=_fake)
define("qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qkv, Tensor positions, "
       "Tensor q_weight, Tensor k_weight, float eps, float theta) -> (Tensor, Tensor, Tensor)",
       qk_norm_rope_backward_reference, fake=_fake_backward)


def _setup(ctx, inputs, output):
    qkv, positions, q_weight, k_weight, eps, theta, num_kv_heads = inputs
    ctx.save_for_backward(qkv, positions, q_weight, k_weight)
    ctx.eps, ctx.theta, ctx.num_kv_heads = eps, theta, num_kv_heads


def _backward(ctx, grad_q, grad_k, grad_v):
    qkv, positions, q_weight, k_weight = ctx.saved_tensors
    shapes = _shapes(qkv, q_weight.shape[0], ctx.num_kv_heads)
    grads = [qkv.new_zeros(shape) if g is None else g for g, shape in zip((grad_q, grad_k, grad_v), shapes)]
    grad_qkv, grad_qw, grad_kw = torch.ops.fw.qk_norm_rope_backward(*grads, qkv, positions, q_weight, k_weight,
                                                                    ctx.eps, ctx.theta)
    return grad_qkv, None, grad_qw, grad_kw, None, None, None


torch.library.register_autograd("fw::qk_norm_rope", _backward, setup_context=_setup)


def kernel_weights(qkv: Tensor, q_weight: Tensor, k_weight: Tensor) -> tuple[Tensor, Tensor]:
    """The norm weights as the kernels take them: float32 or qkv's dtype. Others (bf16 weights under 16-mixed's fp16
    activations) are cast to float32, differentiably, as rms_norm casts them."""
    if q_weight.dtype in (torch.float32, qkv.dtype) and k_weight.dtype == q_weight.dtype:
        return q_weight, k_weight
    return q_weight.float(), k_weight.float()


def _separate_ops(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, theta: float,
                  num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The same maths by rms_norm and rope on views of qkv: the head sizes the CUDA kernel does not take. Each output
    is copied into a storage of its own, as the kernel allocates its outputs: selective recomputation tracks an
    output by its tensor, and would lose a view of rope's [1, N, H, D] output behind that base."""
    q, k, v = _heads(qkv, q_weight.shape[0], num_kv_heads)
    q, k = rope(rms_norm(q, q_weight, eps)[None], rms_norm(k, k_weight, eps)[None], positions[None], theta)
    return q[0].clone(), k[0].clone(), v.clone()


def qk_norm_rope(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, theta: float,
                 num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [N, (Hq + 2 Hk) D] of N tokens at `positions` [N] -> q [N, Hq, D] and k [N, Hk, D] after QK-norm (weights
    [D]) and RoPE, and v [N, Hk, D]. Differentiable in qkv and both weights."""
    op = "qk_norm_rope"
    need_dim(op, "qkv", qkv, 2, "[N, (Hq + 2 Hk) * D]")
    need_dim(op, "positions", positions, 1, "[N]")
    need_long(op, "positions", positions)
    need_dim(op, "q_weight", q_weight, 1, "[D]")
    D = q_weight.shape[0]
    if positions.shape[0] != qkv.shape[0]:
        fail(op, f"`positions` has {positions.shape[0]} entries for {qkv.shape[0]} tokens")
    if (k_weight.shape != q_weight.shape or D == 0 or D % 2 or num_kv_heads < 1 or qkv.shape[1] % D
            or qkv.shape[1] // D <= 2 * num_kv_heads):
        fail(op, f"shapes disagree: qkv {tuple(qkv.shape)}, q_weight {tuple(q_weight.shape)}, k_weight "
                 f"{tuple(k_weight.shape)}, {num_kv_heads} kv heads (expected qkv's width (Hq + 2 Hk) * D with Hq > 0, "
                 "Hk > 0, D > 0 even)")
    need_float(op, qkv=qkv, q_weight=q_weight, k_weight=k_weight)
    q_weight, k_weight = kernel_weights(qkv, q_weight, k_weight)
    if qkv.is_cuda and D not in KERNEL_HEAD_DIMS:
        return _separate_ops(qkv, positions, q_weight, k_weight, eps, theta, num_kv_heads)
    return torch.ops.fw.qk_norm_rope(qkv, positions, q_weight, k_weight, float(eps), float(theta), int(num_kv_heads))
