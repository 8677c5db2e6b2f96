"""qk_norm_rope_write: Qwen3's QK-norm, RoPE and the paged KV-cache write of new tokens in one pass, for the
inference forwards (the rollout's decode and prefill): one kernel where five ran. Schema, checks, torch
reference, fake; no autograd.

From the fused qkv projection's output, q and k are RMS-normalised per head (their norm weights), rotated (NeoX
split-half RoPE at the tokens' positions), k and the untouched v are written into the pools at (block, offset)
and q is returned. The norm's output is rounded to the input's dtype before the rotation, as the separate ops
round it. CUDA kernel: csrc/qk_norm_rope.cu (the training op's forward kernel, writing into the pools).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import define, fail, need_dim, need_long
from ops_cuda.qk_norm_rope import kernel_weights, qk_norm_rope_reference


def qk_norm_rope_write_reference(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                                 theta: float, k_pool: Tensor, v_pool: Tensor, write_blocks: Tensor,
                                 write_offsets: Tensor) -> Tensor:
    q, k, v = qk_norm_rope_reference(qkv, positions, q_weight, k_weight, eps, theta, k_pool.shape[1])
    k_pool[write_blocks, :, write_offsets] = k
    v_pool[write_blocks, :, write_offsets] = v
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
    layer; token i's k and v go to (write_blocks[i], write_offsets[i]). Returns q [N, Hq, D]."""
    op = "qk_norm_rope_write"
    need_dim(op, "qkv", qkv, 2, "[N, (Hq + 2 Hk) * D]")
    need_dim(op, "k_pool", k_pool, 4, "[num_blocks, Hk, block_size, D]")
    for name, t in (("positions", positions), ("write_blocks", write_blocks), ("write_offsets", write_offsets)):
        need_dim(op, name, t, 1, "[N]")
        need_long(op, name, t)
        if t.shape[0] != qkv.shape[0]:
            fail(op, f"`{name}` has {t.shape[0]} entries for {qkv.shape[0]} tokens")
    Hk, D = k_pool.shape[1], k_pool.shape[3]
    if k_pool.shape != v_pool.shape or qkv.shape[1] % D or qkv.shape[1] // D <= 2 * Hk or D % 2:
        fail(op, f"shapes disagree: qkv {tuple(qkv.shape)}, k_pool {tuple(k_pool.shape)}, v_pool "
                 f"{tuple(v_pool.shape)} (expected qkv's width (Hq + 2 Hk) * D, Hq > 0, D even)")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        fail(op, f"q_weight {tuple(q_weight.shape)} and k_weight {tuple(k_weight.shape)} must be [{D}]")
    if qkv.dtype != k_pool.dtype or v_pool.dtype != k_pool.dtype:
        fail(op, f"qkv ({qkv.dtype}) and the pools ({k_pool.dtype}, {v_pool.dtype}) must share a dtype")
    q_weight, k_weight = kernel_weights(qkv, q_weight, k_weight)
    return torch.ops.fw.qk_norm_rope_write(qkv, positions, q_weight, k_weight, float(eps), float(theta), k_pool,
                                           v_pool, write_blocks, write_offsets)
