"""merge_attention_states: fold a second part of one softmax attention into the first, in place, by the two parts'
logsumexps (the merge of split attention: flash-decoding's splits, or a shared prompt's keys and a sequence's own).
Schema, checks, the torch reference (float64-capable), fake. CUDA kernel: csrc/merge_attention.cu.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_dim


def merge_attention_states_reference(out: Tensor, lse: Tensor, other: Tensor, other_lse: Tensor) -> None:
    """In place: out [N, H, D] and lse [H, N] become the attention over both parts' keys. A logsumexp of +-inf
    marks a part without keys, which adds nothing; where neither part has keys, out is 0 and lse -inf. A NaN
    logsumexp counts as a part with keys, so the NaN reaches the result (as the CUDA kernel's branches do)."""
    acc = acc_dtype(out.dtype)
    a, b = lse.to(acc), other_lse.to(acc)
    none_a, none_b = a.isinf(), b.isinf()
    both = ~none_a & ~none_b
    m = torch.where(both, torch.maximum(a, b), 0.0)
    ea, eb = torch.where(both, (a - m).exp(), 0.0), torch.where(both, (b - m).exp(), 0.0)
    s = ea + eb
    only_b = none_a & ~none_b
    wa = torch.where(both, ea / s, 0.0)
    wb = torch.where(both, eb / s, torch.where(only_b, 1.0, 0.0))
    merged = torch.where(both, m + s.log(), torch.where(only_b, b, float("-inf")))
    # a part of weight 0 adds exactly 0, whatever its rows hold (flash leaves a keyless query's row 0, but need not)
    wa3, wb3 = wa.T[..., None], wb.T[..., None]
    result = torch.where(wa3 == 0, 0.0, out.to(acc) * wa3) + torch.where(wb3 == 0, 0.0, other.to(acc) * wb3)
    keep = none_b & ~none_a   # nothing to add: the row and its logsumexp stay as they are, bit for bit
    out.copy_(torch.where(keep.T[..., None], out, result.to(out.dtype)))
    lse.copy_(torch.where(keep, lse, merged.to(lse.dtype)))


define("merge_attention_states(Tensor(a!) out, Tensor(b!) lse, Tensor other, Tensor other_lse) -> ()",
       merge_attention_states_reference, fake=lambda out, lse, other, other_lse: None)


def merge_attention_states(out: Tensor, lse: Tensor, other: Tensor, other_lse: Tensor) -> None:
    """Fold `other` [N, H, D] with its logsumexp `other_lse` [H, N] into `out` [N, H, D] and `lse` [H, N], in
    place: each row becomes (out e^lse + other e^other_lse) / (e^lse + e^other_lse), lse their logaddexp. A
    logsumexp of +inf or -inf marks a part without keys (flash writes +inf), which adds nothing. Views are fine
    (e.g. rows of a larger output); the last dimension of out and other must be contiguous. The logsumexps are
    float32 on CUDA (the accumulation dtype on CPU). Not differentiable."""
    op = "merge_attention_states"
    need_dim(op, "out", out, 3, "[N, H, D]")
    need_dim(op, "lse", lse, 2, "[H, N]")
    need_dim(op, "other", other, 3, "[N, H, D]")
    need_dim(op, "other_lse", other_lse, 2, "[H, N]")
    if other.shape != out.shape or lse.shape != (out.shape[1], out.shape[0]) or other_lse.shape != lse.shape:
        fail(op, f"shapes disagree: out {tuple(out.shape)}, other {tuple(other.shape)}, lse {tuple(lse.shape)}, "
                 f"other_lse {tuple(other_lse.shape)} (expected out == other [N, H, D] and both lse [H, N])")
    if not lse.dtype.is_floating_point:
        fail(op, f"`lse` must be a floating-point tensor, got {lse.dtype}")
    if other.dtype != out.dtype or other_lse.dtype != lse.dtype:
        fail(op, f"dtypes disagree: out {out.dtype}, other {other.dtype}, lse {lse.dtype}, other_lse "
                 f"{other_lse.dtype}")
    torch.ops.fw.merge_attention_states(out, lse, other, other_lse)
