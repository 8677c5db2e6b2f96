"""decode_attention: one query token a sequence against a KV cache of per-row lengths. Schema, argument
checks, torch reference, fake (inference only: no autograd). CUDA kernels: csrc/decode_attention.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, heads_fit, need_device, need_dim, need_long


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor,
                               scale: float) -> Tensor:
    """q [B, Hq, D] attends to cache[b, :, :lengths[b]] ([B, Hk, S, D]); a row of length 0 gives zeros."""
    B, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    acc = acc_dtype(q.dtype)
    qf = q.to(acc).reshape(B, Hk, Hq // Hk, D)
    s = torch.einsum("bgrd,bgsd->bgrs", qf, k_cache.to(acc)) * scale
    valid = torch.arange(S, device=q.device)[None, :] < lengths[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bgrs,bgsd->bgrd", p, v_cache.to(acc))
    return out.reshape(B, Hq, D).to(q.dtype)


define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, float scale) -> Tensor",
       decode_attention_reference, fake=lambda q, k_cache, v_cache, lengths, scale: q.new_empty(q.shape))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """q [B, Hq, D] attends to k/v_cache[b, :, :lengths[b]] ([B, Hk, S, D]); length 0 gives zeros."""
    need_dim("decode_attention", "q", q, 3, "[B, Hq, D]")
    need_dim("decode_attention", "k_cache", k_cache, 4, "[B, Hk, S, D]")
    need_dim("decode_attention", "v_cache", v_cache, 4, "[B, Hk, S, D]")
    need_dim("decode_attention", "lengths", lengths, 1, "[B]")
    need_long("decode_attention", "lengths", lengths)
    B, Hq, D = q.shape
    if (k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D
            or not heads_fit(Hq, k_cache.shape[1]) or lengths.shape[0] != B):
        fail("decode_attention", f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                                 f"v_cache {tuple(v_cache.shape)}, lengths {tuple(lengths.shape)}")
    need_device("decode_attention", "q", q, k_cache=k_cache, v_cache=v_cache, lengths=lengths)
    return torch.ops.fw.decode_attention(q, k_cache, v_cache, lengths, float(scale))
