"""attention: causal GQA attention, optionally within packed documents, as a composite of
scaled_dot_product_attention (flash / memory-efficient kernels on CUDA). It decomposes under autograd and
torch.compile, so it has no fake, autograd or CUDA kernel of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops_cuda.library import define, fail, heads_fit, need_dim, need_long


def document_mask(positions: Tensor) -> Tensor:
    """[B, 1, T, T] bool: causal, and within one packed sequence (a position that is not previous+1
    starts a new one)."""
    T = positions.shape[1]
    start = torch.ones_like(positions, dtype=torch.bool)
    start[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    seg = start.cumsum(1)
    same = seg[:, :, None] == seg[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]


def attention_reference(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, scale: float) -> Tensor:
    """Causal GQA attention on [B, T, H, D] tensors through scaled_dot_product_attention."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if positions is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # K/V expanded to the query heads: with a mask SDPA needs the memory-efficient kernel, which (unlike
        # flash) does not take grouped heads in every torch version, and the math fallback is O(T^2) memory.
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=document_mask(positions), scale=scale)
    return out.transpose(1, 2)


define("attention(Tensor q, Tensor k, Tensor v, Tensor? positions, float scale) -> Tensor", attention_reference,
       composite=True)


def attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, scale: float) -> Tensor:
    """Causal GQA attention on [B, T, H, D]; with positions [B, T], a row holds several sequences:
    a position that is not previous+1 starts a new one. positions=None is plain causal (fastest)."""
    need_dim("attention", "q", q, 4, "[B, T, Hq, D]")
    need_dim("attention", "k", k, 4, "[B, T, Hk, D]")
    need_dim("attention", "v", v, 4, "[B, T, Hk, D]")
    if (k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]
            or not heads_fit(q.shape[2], k.shape[2])):
        fail("attention", f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                          "(expected k == v shapes, same B, T, D, and Hq a multiple of Hk > 0)")
    if positions is not None:
        need_dim("attention", "positions", positions, 2, "[B, T]")
        need_long("attention", "positions", positions)
        if positions.shape != q.shape[:2]:
            fail("attention", f"`positions` must be [B, T] = {tuple(q.shape[:2])} (q's first two sizes), got "
                              f"{tuple(positions.shape)}")
    return torch.ops.fw.attention(q, k, v, positions, float(scale))
