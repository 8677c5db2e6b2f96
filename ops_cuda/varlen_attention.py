"""varlen_attention: causal GQA attention within each sequence of packed [N, H, D] tensors (cu_seqlens,
no mask tensor), and its backward; varlen_suffix_attention: its form whose queries are the last tokens of each
sequence (a prefill over cached context, or completions over a prompt they share), with its backward. Schemas,
argument checks, torch references, fakes, autograd, autocast rules and the CUDA kernels, which are PyTorch's own
varlen flash attention (the kernels behind `torch.nn.attention.varlen.varlen_attn`), so there is no csrc file.
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, heads_fit, need_dim, register_autocast


def packed_sequences(positions: Tensor) -> tuple[Tensor, int]:
    """(cu_seqlens int32 [S + 1], max_seqlen) of the sequences in rows of positions [B, T], flattened
    row after row: a position that is not previous+1 starts a new sequence (ops_cuda.attention's
    document_mask rule), and so does every row. Two host syncs (the sequence count and the longest)."""
    B, T = positions.shape
    flat = positions.reshape(-1)
    start = torch.ones(B, T, dtype=torch.bool, device=positions.device)
    start[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    first = start.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([first, first.new_full((1,), flat.numel())]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max()) if B * T else 0


def _suffix_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """[Hq, n, L] scaled scores of one sequence's last n queries (q [n, Hq, D]) over its L keys (k [L, Hk, D]) in
    the accumulation dtype; query i sits at key position L - n + i and sees the keys up to it (-inf after)."""
    rep = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc).repeat_interleave(rep, dim=1)) * scale
    n, L = q.shape[0], k.shape[0]
    later = torch.arange(L, device=q.device)[None, :] > torch.arange(L - n, L, device=q.device)[:, None]
    return s.masked_fill(later, float("-inf"))


def _spans(cu_q: Tensor, cu_k: Tensor):
    """(qs, qe, ks, ke) of each sequence with at least one query."""
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist())):
        if qe > qs:
            yield qs, qe, ks, ke


def varlen_suffix_attention_reference(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                                      max_k: int, scale: float) -> tuple[Tensor, Tensor]:
    """(out [Nq, Hq, D] in q's dtype, logsumexp [Hq, Nq] in the accumulation dtype): the queries cu_q[i]..cu_q[i+1]
    are the last tokens of sequence i, whose keys are cu_k[i]..cu_k[i+1]; query j of n sits at key position
    len_k - n + j and sees the keys up to it. Query tokens past cu_q[-1] give zeros."""
    acc = acc_dtype(q.dtype)
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=acc, device=q.device)
    for qs, qe, ks, ke in _spans(cu_q, cu_k):
        scores = _suffix_scores(q[qs:qe], k[ks:ke], scale)
        m = scores.logsumexp(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", (scores - m[..., None]).exp(),
                                  v[ks:ke].to(acc).repeat_interleave(rep, dim=1))
        lse[:, qs:qe] = m
    return out.to(q.dtype), lse


def varlen_suffix_attention_backward_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                               lse: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                                               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v) from the forward's out and logsumexp, as flash attention's backward:
    p = exp(s - lse), dS = p (dP - rowsum(dO * O)); the query heads of a kv head add into its gradients."""
    acc = acc_dtype(q.dtype)
    Hq, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    rep = Hq // Hk
    gq = torch.zeros(q.shape, dtype=acc, device=q.device)
    gk = torch.zeros(k.shape, dtype=acc, device=q.device)
    gv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for qs, qe, ks, ke in _spans(cu_q, cu_k):
        L = ke - ks
        p = (_suffix_scores(q[qs:qe], k[ks:ke], scale) - lse[:, qs:qe, None].to(acc)).exp()   # [Hq, n, L]
        do = grad_out[qs:qe].to(acc)
        vv = v[ks:ke].to(acc).repeat_interleave(rep, dim=1)
        kk = k[ks:ke].to(acc).repeat_interleave(rep, dim=1)
        delta = (do * out[qs:qe].to(acc)).sum(-1).T                                           # [Hq, n]
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta[..., None])
        gq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        gk[ks:ke] = (torch.einsum("hqk,qhd->khd", ds, q[qs:qe].to(acc)) * scale).reshape(L, Hk, rep, D).sum(2)
        gv[ks:ke] = torch.einsum("hqk,qhd->khd", p, do).reshape(L, Hk, rep, D).sum(2)
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


def varlen_attention_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                               scale: float) -> tuple[Tensor, Tensor]:
    """(out [N, Hq, D] in q's dtype, logsumexp [Hq, N] in the accumulation dtype): each sequence
    cu_seqlens[i]..cu_seqlens[i+1] - 1 attends causally to itself alone, one [L, L] score block at a time."""
    return varlen_suffix_attention_reference(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale)


def varlen_attention_backward_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                        lse: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """varlen_attention's (grad_q, grad_k, grad_v): varlen_suffix_attention's backward with every key a query."""
    return varlen_suffix_attention_backward_reference(grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens,
                                                      max_seqlen, max_seqlen, scale)


# ---------------------------------------------------------------- CUDA: PyTorch's varlen flash attention
@functools.cache
def _flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def flash_serves(q: Tensor) -> bool:
    """Whether the CUDA kernel is PyTorch's varlen flash attention for q (16-bit, head_dim a multiple of 8
    up to 256, compute capability >= 8.0, a torch with the kernel); otherwise the reference serves."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward")
            and _flash_capable(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def _last_dim_dense(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                  scale: float) -> tuple[Tensor, Tensor]:
    """(out, logsumexp [Hq, Nq]) of PyTorch's varlen flash attention, no dropout; causal aligns the mask to the bottom
    right of each sequence's [n, L] block."""
    # The aten op rather than the public varlen_attn wrapper: its arguments changed between torch releases
    # (is_causal, then window_size), the aten schema did not, and the backward needs the logsumexp.
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v), cu_q, cu_k, max_q, max_k, 0.0, causal, False,
        scale=scale)
    return out, lse


def flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                   cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v) of `flash_forward` given its out and logsumexp."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)   # read only under dropout
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v), out, lse.contiguous(),
        cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale)
    return dq, dk, dv


def _varlen_attention_cuda(q, k, v, cu_seqlens, max_seqlen, scale):
    if not flash_serves(q):
        return varlen_attention_reference(q, k, v, cu_seqlens.cpu(), max_seqlen, scale)
    return flash_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, scale)


def _varlen_attention_backward_cuda(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    if not flash_serves(q):
        return varlen_attention_backward_reference(grad_out, q, k, v, out, lse, cu_seqlens.cpu(), max_seqlen, scale)
    return flash_backward(grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, scale)


def _varlen_suffix_attention_cuda(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    if not flash_serves(q):
        return varlen_suffix_attention_reference(q, k, v, cu_q.cpu(), cu_k.cpu(), max_q, max_k, scale)
    # flash's causal mask is aligned to the bottom right of each sequence's [n, L] block: the suffix rule
    return flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, True, scale)


def _varlen_suffix_attention_backward_cuda(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale):
    if not flash_serves(q):
        return varlen_suffix_attention_backward_reference(grad_out, q, k, v, out, lse, cu_q.cpu(), cu_k.cpu(), max_q,
                                                          max_k, scale)
    return flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, True, scale)


def _fake(q, k, v, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype))


def _backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


define("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float scale) "
       "-> (Tensor, Tensor)", varlen_attention_reference, fake=_fake, cuda=_varlen_attention_cuda)
define("varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
       "Tensor cu_seqlens, SymInt max_seqlen, float scale) -> (Tensor, Tensor, Tensor)",
       varlen_attention_backward_reference, fake=_backward_fake, cuda=_varlen_attention_backward_cuda)

define("varlen_suffix_attention(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, SymInt max_q, SymInt max_k, "
       "float scale) -> (Tensor, Tensor)", varlen_suffix_attention_reference,
       fake=lambda q, k, v, cu_q, cu_k, max_q, max_k, scale: _fake(q, k, v, cu_q, max_q, scale),
       cuda=_varlen_suffix_attention_cuda)
define("varlen_suffix_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
       "Tensor cu_q, Tensor cu_k, SymInt max_q, SymInt max_k, float scale) -> (Tensor, Tensor, Tensor)",
       varlen_suffix_attention_backward_reference,
       fake=lambda grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale: _backward_fake(
           grad_out, q, k, v, out, lse, cu_q, max_q, scale),
       cuda=_varlen_suffix_attention_backward_cuda)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _backward(ctx, grad_out, grad_lse):
    # lse is an auxiliary output for the backward; the public function never returns it.
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.fw.varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen,
                                                        ctx.scale)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("fw::varlen_attention", _backward, setup_context=_setup)


def _suffix_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale


def _suffix_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.fw.varlen_suffix_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, ctx.max_q,
                                                               ctx.max_k, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("fw::varlen_suffix_attention", _suffix_backward, setup_context=_suffix_setup)

# Under autocast the attention runs in the region's 16-bit dtype, as scaled_dot_product_attention does (flash
# takes 16-bit only).
register_autocast("varlen_attention")
register_autocast("varlen_suffix_attention")


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    """Causal GQA attention on packed q [N, Hq, D], k, v [N, Hk, D]: the tokens cu_seqlens[i] ..
    cu_seqlens[i+1] - 1 form sequence i and attend only within it. cu_seqlens: int32 [S + 1], 0 first and
    N last; max_seqlen: at least the longest sequence (`packed_sequences` gives both)."""
    need_dim("varlen_attention", "q", q, 3, "[N, Hq, D]")
    need_dim("varlen_attention", "k", k, 3, "[N, Hk, D]")
    need_dim("varlen_attention", "v", v, 3, "[N, Hk, D]")
    need_dim("varlen_attention", "cu_seqlens", cu_seqlens, 1, "[S + 1]")
    if cu_seqlens.dtype != torch.int32:
        fail("varlen_attention", f"`cu_seqlens` must be int32, got {cu_seqlens.dtype}")
    if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or not heads_fit(q.shape[1], k.shape[1])):
        fail("varlen_attention", f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                                 "(expected k == v shapes, same N and D, and Hq a multiple of Hk > 0)")
    return torch.ops.fw.varlen_attention(q, k, v, cu_seqlens, max_seqlen, float(scale))[0]


def varlen_suffix_attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                            scale: float) -> Tensor:
    """Causal GQA attention of packed queries q [Nq, Hq, D] that are the last tokens of their sequences, over
    packed k, v [Nk, Hk, D] holding the sequences' every token: the queries cu_q[i]..cu_q[i+1] - 1 of sequence
    i attend to its keys cu_k[i]..cu_k[i+1] - 1 up to their own positions (each sequence has at least as many
    keys as queries). cu_q, cu_k: int32 [S + 1]; max_q, max_k: at least the most queries / keys of a sequence.
    With cu_q == cu_k it is varlen_attention. Differentiable; keys gathered from one tensor for several sequences
    (a prompt they share) get their gradients summed by the gather's backward."""
    need_dim("varlen_suffix_attention", "q", q, 3, "[Nq, Hq, D]")
    need_dim("varlen_suffix_attention", "k", k, 3, "[Nk, Hk, D]")
    need_dim("varlen_suffix_attention", "v", v, 3, "[Nk, Hk, D]")
    for name, cu in (("cu_q", cu_q), ("cu_k", cu_k)):
        need_dim("varlen_suffix_attention", name, cu, 1, "[S + 1]")
        if cu.dtype != torch.int32:
            fail("varlen_suffix_attention", f"`{name}` must be int32, got {cu.dtype}")
    if cu_q.shape != cu_k.shape:
        fail("varlen_suffix_attention", f"cu_q {tuple(cu_q.shape)} and cu_k {tuple(cu_k.shape)} must count the same "
                                        "sequences")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or not heads_fit(q.shape[1], k.shape[1]):
        fail("varlen_suffix_attention", f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                        f"v {tuple(v.shape)} (expected k == v shapes, the same D, and Hq a multiple "
                                        "of Hk > 0)")
    return torch.ops.fw.varlen_suffix_attention(q, k, v, cu_q, cu_k, max_q, max_k, float(scale))[0]
