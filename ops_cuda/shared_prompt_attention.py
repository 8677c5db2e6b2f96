"""shared_prompt_attention: causal GQA attention over one packed row that holds each group's prompt once, then the
group's completions. A prompt attends causally to itself; token j of a completion attends to every key of its group's
prompt and to its own completion's tokens 0..j, as if each sequence (prompt, then completion) were laid out whole.

On CUDA it is two calls of PyTorch's varlen flash attention and a merge: every sequence over itself (causal), then
each group's completion tokens over the group's prompt (no mask), folded into the first result by the two
logsumexps (ops_cuda.merge_attention_states, one kernel). The backward runs flash's backward on each part with the
merged output and logsumexp, which gives each part's exact share of the gradients, so no key is gathered per
completion and no gradient is scattered back. Where every completion has one length, no shorter than any prompt,
the completions' part runs as equal rows through cuDNN's attention, whose Hopper kernel is faster than flash's on
equal rows (and so does the part over the prompts where every prompt, and every group's completion tokens, have one
length too). Schemas, checks, the float64-capable reference, fakes, autograd and autocast rules; no csrc file of its
own.
"""
from __future__ import annotations

import functools
import itertools
import os

import torch
from torch import Tensor

import ops_cuda.merge_attention  # noqa: F401 (defines fw::merge_attention_states, which the CUDA forward calls)
from ops_cuda.library import acc_dtype, define, fail, heads_fit, need_dim, register_autocast
from ops_cuda.varlen_attention import (
    flash_backward,
    flash_forward,
    flash_serves,
    varlen_suffix_attention_backward_reference,
    varlen_suffix_attention_reference,
)


def _contexts(prompt_tokens: int, cu_prompts: Tensor, cu_groups: Tensor, cu_seqs: Tensor) -> list[Tensor]:
    """Each sequence's keys as host indices into the row: a prompt's are its own tokens; a completion's are its
    group's prompt, then its own tokens."""
    cu_p, cu_g = cu_prompts.cpu().long(), cu_groups.cpu().long()
    contexts = []
    for s, e in itertools.pairwise(cu_seqs.cpu().tolist()):
        own = torch.arange(s, e)
        if s >= prompt_tokens and e > s:
            # the group whose completion tokens hold this sequence's first
            g = min(int(torch.searchsorted(cu_g[1:], torch.tensor(s - prompt_tokens), right=True)), len(cu_g) - 2)
            own = torch.cat([torch.arange(int(cu_p[g]), int(cu_p[g + 1])), own])
        contexts.append(own)
    return contexts


def _gathered(k: Tensor, v: Tensor, contexts: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """(index, k, v of each sequence's keys, sequence after sequence; cu_k; the most keys of a sequence)."""
    index = torch.cat([torch.zeros(0, dtype=torch.long), *contexts]).to(k.device)
    lens = [len(c) for c in contexts]
    cu_k = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    return index, k[index], v[index], cu_k, max(lens, default=0)


def shared_prompt_attention_reference(q: Tensor, k: Tensor, v: Tensor, prompt_tokens: int, cu_prompts: Tensor,
                                      cu_groups: Tensor, cu_seqs: Tensor, max_prompt: int, max_group: int,
                                      max_seq: int, scale: float) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, D] in q's dtype, logsumexp [Hq, T] in the accumulation dtype): each sequence's keys gathered
    (a completion's: its prompt's, then its own) and attended by varlen_suffix_attention's reference."""
    _, kc, vc, cu_k, max_k = _gathered(k, v, _contexts(prompt_tokens, cu_prompts, cu_groups, cu_seqs))
    return varlen_suffix_attention_reference(q, kc, vc, cu_seqs.cpu(), cu_k, max_seq, max_k, scale)


def shared_prompt_attention_backward_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                               lse: Tensor, prompt_tokens: int, cu_prompts: Tensor, cu_groups: Tensor,
                                               cu_seqs: Tensor, max_prompt: int, max_group: int, max_seq: int,
                                               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v): varlen_suffix_attention's backward reference over the gathered keys; a prompt
    key's gradient sums over its prompt's tokens and every completion of its group."""
    index, kc, vc, cu_k, max_k = _gathered(k, v, _contexts(prompt_tokens, cu_prompts, cu_groups, cu_seqs))
    gq, gkc, gvc = varlen_suffix_attention_backward_reference(grad_out, q, kc, vc, out, lse, cu_seqs.cpu(), cu_k,
                                                              max_seq, max_k, scale)
    acc = acc_dtype(q.dtype)
    gk = torch.zeros(k.shape, dtype=acc, device=k.device).index_add_(0, index, gkc.to(acc))
    gv = torch.zeros(v.shape, dtype=acc, device=v.device).index_add_(0, index, gvc.to(acc))
    return gq, gk.to(k.dtype), gv.to(v.dtype)


# ---------------------------------------------------------------- CUDA: two flash calls and a merge
def _flash_max(m: int) -> int:
    # flash's one-query path (max_seqlen_q == 1 with grouped heads) assumes every sequence holds exactly one query;
    # a larger bound keeps the general path, which skips empty sequences
    return max(int(m), 2)


@functools.cache
def _cudnn_capable(device_index: int) -> bool:
    return (torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device_index) >= (9, 0)
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"))


def dense_rows(tokens: int, prompt_tokens: int, groups: int, seqs: int, max_prompt: int, max_group: int,
               max_seq: int) -> tuple[int, bool]:
    """(the completions' length, or 0 where they are not equal rows; whether the part over the prompts is equal rows
    too) of a layout, from its sizes alone. The completions are equal rows where their tokens are their count times
    `max_seq`: none is longer, so each is that long. The part over the prompts is where, besides, every prompt is
    `max_prompt` tokens long and every group's completions `max_group` (so each group holds as many)."""
    completions, n = seqs - groups, tokens - prompt_tokens
    if completions <= 0 or n != completions * max_seq:
        return 0, False
    return max_seq, bool(prompt_tokens) and prompt_tokens == groups * max_prompt and n == groups * max_group


def _cudnn_serves(q: Tensor) -> bool:
    """Whether cuDNN's attention takes q's equal rows: 16-bit, head_dim a multiple of 8 up to 128, Hopper or later,
    no strict determinism (its backward is not deterministic); FW_CUDNN_ATTENTION=0 turns it off, to compare."""
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and os.environ.get("FW_CUDNN_ATTENTION", "1") != "0" and not torch.are_deterministic_algorithms_enabled()
            and _cudnn_capable(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def _rows(t: Tensor, rows: int) -> Tensor:
    """[T, H, D] tokens as [rows, T / rows, H, D] and then cuDNN's [rows, H, T / rows, D] view: no copy."""
    return t.view(rows, -1, *t.shape[1:]).transpose(1, 2)


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, rows: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, D], logsumexp [Hq, T] float32) of q's `rows` equal rows over k's and v's (top-left causal)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _rows(q, rows), _rows(k, rows), _rows(v, rows), None, True, 0.0, causal, False, scale=scale)
    return out.transpose(1, 2).reshape(q.shape), lse.reshape(rows, q.shape[1], -1).transpose(0, 1).reshape(
        q.shape[1], -1)


def _cudnn_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rows: int,
                    causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v) of `_cudnn_forward`, from the given out and logsumexp [Hq, T]."""
    stats = lse.reshape(q.shape[1], rows, -1).transpose(0, 1).contiguous().unsqueeze(-1)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)   # read only under dropout
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _rows(grad_out, rows), _rows(q, rows), _rows(k, rows), _rows(v, rows), _rows(out, rows), stats, seed, seed,
        None, None, None, q.shape[0] // rows, k.shape[0] // rows, 0.0, causal, scale=scale)
    return tuple(g.transpose(1, 2).reshape(x.shape) for g, x in zip(grads, (q, k, v), strict=True))


def _shared_prompt_attention_cuda(q, k, v, prompt_tokens, cu_prompts, cu_groups, cu_seqs, max_prompt, max_group,
                                  max_seq, scale):
    if not flash_serves(q):
        return shared_prompt_attention_reference(q, k, v, prompt_tokens, cu_prompts, cu_groups, cu_seqs, max_prompt,
                                                 max_group, max_seq, scale)
    P = prompt_tokens
    G = cu_prompts.shape[0] - 1
    length, cross_rows = dense_rows(q.shape[0], P, G, cu_seqs.shape[0] - 1, max_prompt, max_group, max_seq)
    if length and _cudnn_serves(q):
        # the prompts over themselves (flash: they may differ in length), the completions as equal rows (cuDNN)
        C = (q.shape[0] - P) // length
        o_c, lse_c = _cudnn_forward(q[P:], k[P:], v[P:], C, True, scale)
        if P:
            if cross_rows:
                o_x, lse_x = _cudnn_forward(q[P:], k[:P], v[:P], G, False, scale)
            else:
                o_x, lse_x = flash_forward(q[P:], k[:P], v[:P], cu_groups, cu_prompts, _flash_max(max_group),
                                           max_prompt, False, scale)
            torch.ops.fw.merge_attention_states(o_c, lse_c, o_x, lse_x)
            m = _flash_max(max_prompt)
            o_p, lse_p = flash_forward(q[:P], k[:P], v[:P], cu_prompts, cu_prompts, m, m, True, scale)
            return torch.cat([o_p, o_c]), torch.cat([lse_p, lse_c], 1)
        return o_c, lse_c
    m = _flash_max(max_seq)
    out, lse = flash_forward(q, k, v, cu_seqs, cu_seqs, m, m, True, scale)
    if q.shape[0] > P > 0:
        # the completions over their group's prompt, merged into their own part by the two logsumexps
        o_p, lse_p = flash_forward(q[P:], k[:P], v[:P], cu_groups, cu_prompts, _flash_max(max_group), max_prompt,
                                   False, scale)
        torch.ops.fw.merge_attention_states(out[P:], lse[:, P:], o_p, lse_p)
    return out, lse


def _shared_prompt_attention_backward_cuda(grad_out, q, k, v, out, lse, prompt_tokens, cu_prompts, cu_groups,
                                           cu_seqs, max_prompt, max_group, max_seq, scale):
    if not flash_serves(q):
        return shared_prompt_attention_backward_reference(grad_out, q, k, v, out, lse, prompt_tokens, cu_prompts,
                                                          cu_groups, cu_seqs, max_prompt, max_group, max_seq, scale)
    # With the merged out and logsumexp each part's backward gives its exact share: p = exp(s - lse) is the
    # probability under the whole softmax, and rowsum(dO * O) is the whole output's.
    P = prompt_tokens
    G = cu_prompts.shape[0] - 1
    length, cross_rows = dense_rows(q.shape[0], P, G, cu_seqs.shape[0] - 1, max_prompt, max_group, max_seq)
    grad_out = grad_out.contiguous()
    if length and _cudnn_serves(q):
        C = (q.shape[0] - P) // length
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq_c, dk[P:], dv[P:] = _cudnn_backward(grad_out[P:], q[P:], k[P:], v[P:], out[P:], lse[:, P:], C, True,
                                               scale)
        if not P:
            return dq_c, dk, dv
        dq = torch.empty_like(q)
        m = _flash_max(max_prompt)
        dq[:P], dk[:P], dv[:P] = flash_backward(grad_out[:P], q[:P], k[:P], v[:P], out[:P], lse[:, :P], cu_prompts,
                                                cu_prompts, m, m, True, scale)
        if cross_rows:
            dq_x, dk_x, dv_x = _cudnn_backward(grad_out[P:], q[P:], k[:P], v[:P], out[P:], lse[:, P:], G, False,
                                               scale)
        else:
            dq_x, dk_x, dv_x = flash_backward(grad_out[P:], q[P:], k[:P], v[:P], out[P:], lse[:, P:], cu_groups,
                                              cu_prompts, _flash_max(max_group), max_prompt, False, scale)
        torch.add(dq_c, dq_x, out=dq[P:])
        dk[:P] += dk_x
        dv[:P] += dv_x
        return dq, dk, dv
    m = _flash_max(max_seq)
    dq, dk, dv = flash_backward(grad_out, q, k, v, out, lse, cu_seqs, cu_seqs, m, m, True, scale)
    if q.shape[0] > P > 0:
        dq_p, dk_p, dv_p = flash_backward(grad_out[P:], q[P:], k[:P], v[:P], out[P:], lse[:, P:], cu_groups,
                                          cu_prompts, _flash_max(max_group), max_prompt, False, scale)
        dq[P:] += dq_p
        dk[:P] += dk_p
        dv[:P] += dv_p
    return dq, dk, dv


def _fake(q, k, v, *rest):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype))


def _backward_fake(grad_out, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_ARGS = ("SymInt prompt_tokens, Tensor cu_prompts, Tensor cu_groups, Tensor cu_seqs, SymInt max_prompt, "
         "SymInt max_group, SymInt max_seq, float scale")
define(f"shared_prompt_attention(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor)",
       shared_prompt_attention_reference, fake=_fake, cuda=_shared_prompt_attention_cuda)
define(f"shared_prompt_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
       f"{_ARGS}) -> (Tensor, Tensor, Tensor)",
       shared_prompt_attention_backward_reference, fake=_backward_fake, cuda=_shared_prompt_attention_backward_cuda)


def _setup(ctx, inputs, output):
    q, k, v, prompt_tokens, cu_prompts, cu_groups, cu_seqs, max_prompt, max_group, max_seq, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu_prompts, cu_groups, cu_seqs)
    ctx.sizes = (max_prompt, max_group, max_seq, scale)
    ctx.prompt_tokens = prompt_tokens


def _backward(ctx, grad_out, grad_lse):
    # lse is an auxiliary output for the backward; the public function never returns it.
    q, k, v, out, lse, cu_prompts, cu_groups, cu_seqs = ctx.saved_tensors
    grads = torch.ops.fw.shared_prompt_attention_backward(grad_out, q, k, v, out, lse, ctx.prompt_tokens, cu_prompts,
                                                          cu_groups, cu_seqs, *ctx.sizes)
    return (*grads, None, None, None, None, None, None, None, None)


torch.library.register_autograd("fw::shared_prompt_attention", _backward, setup_context=_setup)
# Under autocast the attention runs in the region's 16-bit dtype, as scaled_dot_product_attention does (flash
# takes 16-bit only).
register_autocast("shared_prompt_attention")


def shared_prompt_attention(q: Tensor, k: Tensor, v: Tensor, prompt_tokens: int, cu_prompts: Tensor,
                            cu_groups: Tensor, cu_seqs: Tensor, max_prompt: int, max_group: int, max_seq: int,
                            scale: float) -> Tensor:
    """Causal GQA attention over one packed row q [T, Hq, D], k, v [T, Hk, D] that holds groups' prompts, each
    once (its first `prompt_tokens` tokens), then the groups' completions.

    cu_prompts [G + 1] splits the prompts into groups; cu_groups [G + 1] splits the completion tokens (counted from
    the first of them) into the same groups; cu_seqs [S + 1] splits the row into sequences: each prompt (an empty
    one too), then each non-empty completion (its values include every cu_prompts value, and prompt_tokens + every
    cu_groups value). A
    prompt token attends causally within its prompt; token j of a completion attends to its group's whole prompt
    and to the completion's tokens 0..j. cu_*: int32, 0 first; max_*: at least the longest prompt, group (its
    completions' tokens together) and sequence. The checks read shapes only: cu values that break these rules give
    wrong results, not an error. Differentiable in q, k and v."""
    op = "shared_prompt_attention"
    need_dim(op, "q", q, 3, "[T, Hq, D]")
    need_dim(op, "k", k, 3, "[T, Hk, D]")
    need_dim(op, "v", v, 3, "[T, Hk, D]")
    for name, cu, layout in (("cu_prompts", cu_prompts, "[G + 1]"), ("cu_groups", cu_groups, "[G + 1]"),
                             ("cu_seqs", cu_seqs, "[S + 1]")):
        need_dim(op, name, cu, 1, layout)
        if cu.dtype != torch.int32:
            fail(op, f"`{name}` must be int32, got {cu.dtype}")
    if cu_prompts.shape != cu_groups.shape:
        fail(op, f"cu_prompts {tuple(cu_prompts.shape)} and cu_groups {tuple(cu_groups.shape)} must count the same "
                 "groups")
    if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or not heads_fit(q.shape[1], k.shape[1])):
        fail(op, f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (expected k == v "
                 "shapes, the same T and D, and Hq a multiple of Hk > 0)")
    if not 0 <= prompt_tokens <= q.shape[0]:
        fail(op, f"prompt_tokens {prompt_tokens} must lie in 0..{q.shape[0]} (the row's tokens)")
    return torch.ops.fw.shared_prompt_attention(q, k, v, prompt_tokens, cu_prompts, cu_groups, cu_seqs, max_prompt,
                                                max_group, max_seq, float(scale))[0]
