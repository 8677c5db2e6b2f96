"""qk_norm_rope_write: Qwen3's QK-norm, RoPE and the paged KV-cache write of new tokens in one pass, for the
inference forwards (the rollout's decode and prefill): one kernel where five ran. Schema, checks, torch
reference, fake; no autograd.

From the fused qkv projection's output, q and k are RMS-normalised per head (their norm weights), rotated (NeoX
split-half RoPE at the tokens' positions), k and the untouched v are written into the pools at (block, offset)
and q is returned. The norm's output is rounded to the input's dtype before the rotation, as the separate ops
round it. The pools hold qkv's dtype, or float8_e4m3fn: k and v rounded from qkv's dtype to nearest e4m3, saturating.
CUDA kernel: csrc/qk_norm_rope.cu (the training op's forward kernel, writing into the pools).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import define, fail, need_dim, need_float, need_long
from ops_cuda.qk_norm_rope import kernel_weights, qk_norm_rope_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448: float8 pools saturate there, as the kernel's satfinite conversion does


def as_pool(t: Tensor, pool: Tensor) -> Tensor:
    """t as `pool` stores it: in the pool's dtype; for a float8 pool clamped to +-448, then rounded to nearest e4m3."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(FP8) if pool.dtype == FP8 else t.to(pool.dtype)


def qk_norm_rope_write_reference(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                                 theta: float, k_pool: Tensor, v_pool: Tensor, write_blocks: Tensor,
                                 write_offsets: Tensor) -> Tensor:
    q, k, v = qk_norm_rope_reference(qkv, positions, q_weight, k_weight, eps, theta, k_pool.shape[1])
    k_pool[write_blocks, :, write_offsets] = as_pool(k, k_pool)
    v_pool[write_blocks, :, write_offsets] = as_pool(v, v_pool)
    return q.contiguous()


def _fake(qkv, positions, q_weight, k_weight, eps, theta, k_pool, v_pool, write_blocks, write_offsets):
    D = k_pool.shape[3]
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // D - 2 * k_pool.shape[1], D))


define("qk_norm_rope_write(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, float eps, float theta, "
       "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_blocks, Tensor write_offsets) -> Tensor",
       qk_norm_rope_write_reference, fake=_fake)


def qk_norm_rope_write(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, theta: float,
                       k_pool: Tensor, v_pool: Tensor, write_blocks: Tensor, write_offsets: Tensor) -> Tensor:
    """qkv [N, (Hq + 2 Hk) D] of N new tokens at `positions` [N]; pools [num_blocks, Hk, block_size, D] of one
    layer, in qkv's dtype or float8_e4m3fn; token i's k and v go to (write_blocks[i], write_offsets[i]). Returns
    q [N, Hq, D] in qkv's dtype."""
    op = "qk_norm_rope_write"
    need_dim(op, "qkv", qkv, 2, "[N, (Hq + 2 Hk) * D]")
    need_dim(op, "k_pool", k_pool, 4, "[num_blocks, Hk, block_size, D]")
    for name, t in (("positions", positions), ("write_blocks", write_blocks), ("write_offsets", write_offsets)):
        need_dim(op, name, t, 1, "[N]")
        need_long(op, name, t)
        if t.shape[0] != qkv.shape[0]:
            fail(op, f"`{name}` has {t.shape[0]} entries for {qkv.shape[0]} tokens")
    Hk, D = k_pool.shape[1], k_pool.shape[3]
    if k_pool.shape != v_pool.shape or D == 0 or D % 2 or Hk == 0 or qkv.shape[1] % D or qkv.shape[1] // D <= 2 * Hk:
        fail(op, f"shapes disagree: qkv {tuple(qkv.shape)}, k_pool {tuple(k_pool.shape)}, v_pool "
                 f"{tuple(v_pool.shape)} (expected qkv's width (Hq + 2 Hk) * D, Hq > 0, Hk > 0, D > 0 even)")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        fail(op, f"q_weight {tuple(q_weight.shape)} and k_weight {tuple(k_weight.shape)} must be [{D}]")
    need_float(op, qkv=qkv, q_weight=q_weight, k_weight=k_weight)
    if k_pool.dtype not in (qkv.dtype, FP8) or v_pool.dtype != k_pool.dtype:
        fail(op, f"the pools ({k_pool.dtype}, {v_pool.dtype}) must both be qkv's dtype ({qkv.dtype}) or {FP8}")
    q_weight, k_weight = kernel_weights(qkv, q_weight, k_weight)
    return torch.ops.fw.qk_norm_rope_write(qkv, positions, q_weight, k_weight, float(eps), float(theta), k_pool,
                                           v_pool, write_blocks, write_offsets)
