"""linear_logprob: the fused lm_head GEMM + log softmax gathered at the targets (+ entropy), and its backward.
Schemas, argument checks, torch references, fakes, autograd, autocast rule. CUDA kernels:
csrc/linear_logprob.cu (with csrc/linear_logprob_sm90.cuh, its Hopper kernel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops_cuda.library import acc_dtype, define, fail, need_device, need_dim, need_long, register_autocast

# Vocabulary columns per offset of the saved logits (linear_logprob with save_logits): the chunk that the CUDA
# forward reduces, a warp's in the row kernels and a column block of the Hopper kernel (kLogprobChunk in
# csrc/linear_logprob.cu).
SAVED_LOGITS_CHUNK = 256
# Bytes of the [rows, V] float32 logits tile that the reference holds at once: bounded memory for any vocab.
LOGITS_TILE_BYTES = 1 << 28
# float16's largest finite magnitude: a shifted logit below -65504 is stored as -65504 (its exp is 0 anyway).
FP16_MIN = -65504.0


def chunk_rows(n: int, vocab: int) -> int:
    return max(1, min(n, LOGITS_TILE_BYTES // (4 * max(vocab, 1))))


def saves_logits(dtype: torch.dtype, save_chunk: int) -> bool:
    """Whether linear_logprob keeps its shifted logits for the backward: asked for (save_chunk > 0) and
    16-bit operands, whose gradient GEMMs round dz to 16 bits anyway; fp32 and fp64 always recompute."""
    return save_chunk > 0 and dtype in (torch.bfloat16, torch.float16)


def linear_logprob_reference(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                             save_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logprob, entropy, logsumexp, saved, offsets): the first three [N] in float32, of
    softmax(hidden @ weight.T / temperature), computed over row chunks. A negative target (ignore index)
    gives logprob 0. When `saves_logits`: offsets [N, ceil(V / save_chunk)] (float32) is the max logit of each
    chunk of save_chunk vocabulary columns and saved [N, V] (float16) the logits minus their chunk's max;
    otherwise both are empty."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    wf = weight.to(acc)
    lp, ent, lse = (torch.empty(N, dtype=acc, device=hidden.device) for _ in range(3))
    save = saves_logits(hidden.dtype, save_chunk)
    chunks = -(-V // save_chunk) if save else 0
    saved = hidden.new_empty((N, V) if save else (0,), dtype=torch.float16)
    offsets = hidden.new_empty((N, chunks) if save else (0,), dtype=torch.float32)
    step = chunk_rows(N, V)
    for s in range(0, N, step):
        z = (hidden[s:s + step].to(acc) @ wf.T) / temperature
        t = targets[s:s + step]
        if bool((t >= V).any()):
            raise IndexError(f"linear_logprob: a target is >= the vocabulary size {V}")
        m = z.logsumexp(-1)
        logp = z - m[:, None]
        picked = logp.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
        lp[s:s + step] = torch.where(t < 0, torch.zeros_like(picked), picked)
        ent[s:s + step] = -(logp.exp() * logp).sum(-1)
        lse[s:s + step] = m
        if save:
            padded = F.pad(z, (0, chunks * save_chunk - V), value=float("-inf"))
            off = padded.view(z.shape[0], chunks, save_chunk).amax(-1)
            off = torch.where(off == float("-inf"), torch.zeros_like(off), off)  # an all -inf chunk: shift 0
            shifted = z - off.repeat_interleave(save_chunk, dim=1)[:, :V]
            saved[s:s + step] = shifted.clamp(min=FP16_MIN).half()
            offsets[s:s + step] = off
    return lp, ent, lse, saved, offsets


def linear_logprob_backward_reference(grad_logprob: Tensor, grad_entropy: Tensor, hidden: Tensor, weight: Tensor,
                                      targets: Tensor, lse: Tensor, entropy: Tensor, saved: Tensor,
                                      offsets: Tensor, temperature: float, save_chunk: int = 0,
                                      weight_grad: bool = True) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight) from the saved shifted logits when the forward kept them (saved
    non-empty), else recomputing the logits chunk by chunk. Without weight_grad (a frozen weight, as under
    LoRA) grad_weight is an empty tensor and its GEMM is skipped.
    d logprob/dz = onehot - p; d entropy/dz = -p (log p + H); z = logits / temperature."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    wf = weight.to(acc)
    gh = torch.empty_like(hidden)
    gw = torch.zeros(weight.shape if weight_grad else (0,), dtype=acc, device=weight.device)
    use_saved = saved.numel() > 0
    step = chunk_rows(N, V)
    for s in range(0, N, step):
        hc = hidden[s:s + step].to(acc)
        if use_saved:
            off = offsets[s:s + step].to(acc).repeat_interleave(save_chunk, dim=1)[:, :V]
            logp = saved[s:s + step].to(acc) + (off - lse[s:s + step, None].to(acc))
        else:
            logp = (hc @ wf.T) / temperature - lse[s:s + step, None].to(acc)
        p = logp.exp()
        t = targets[s:s + step]
        glp = torch.where(t < 0, 0.0, grad_logprob[s:s + step].to(acc))
        g = -grad_entropy[s:s + step, None].to(acc) * p * (logp + entropy[s:s + step, None].to(acc))
        g = g - glp[:, None] * p
        g.scatter_add_(1, t.clamp(min=0)[:, None], glp[:, None])
        g = g / temperature
        gh[s:s + step] = (g @ wf).to(hidden.dtype)
        if weight_grad:
            gw += g.T @ hc
    return gh, gw.to(weight.dtype)


def _fake(hidden, weight, targets, temperature, save_chunk=0):
    acc = acc_dtype(hidden.dtype)
    n, v = hidden.shape[0], weight.shape[0]
    save = saves_logits(hidden.dtype, save_chunk)
    saved = hidden.new_empty((n, v) if save else (0,), dtype=torch.float16)
    offsets = hidden.new_empty((n, -(-v // save_chunk)) if save else (0,), dtype=torch.float32)
    return (hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc),
            saved, offsets)


def _backward_fake(grad_logprob, grad_entropy, hidden, weight, targets, lse, entropy, saved, offsets, temperature,
                   save_chunk=0, weight_grad=True):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape if weight_grad else (0,))


define("linear_logprob(Tensor hidden, Tensor weight, Tensor targets, float temperature, int save_chunk=0) "
       "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", linear_logprob_reference, fake=_fake)
define("linear_logprob_backward(Tensor grad_logprob, Tensor grad_entropy, Tensor hidden, Tensor weight, "
       "Tensor targets, Tensor lse, Tensor entropy, Tensor saved, Tensor offsets, float temperature, "
       "int save_chunk=0, bool weight_grad=True) -> (Tensor, Tensor)", linear_logprob_backward_reference,
       fake=_backward_fake)


def _setup(ctx, inputs, output):
    hidden, weight, targets, temperature = inputs[:4]
    _, entropy, lse, saved, offsets = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy, saved, offsets)
    ctx.temperature, ctx.save_chunk = temperature, inputs[4] if len(inputs) > 4 else 0
    # Outputs without a gradient arrive as None instead of zeros: zeros for `saved` would be a whole [N, V]
    # tensor written and read for nothing (`python -m benchmarks.ops.profile_ops linear_logprob` shows the cost).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logprob, grad_entropy, grad_lse, grad_saved, grad_offsets):
    # lse, saved and offsets are auxiliary outputs for the backward; the public API never returns them.
    hidden, weight, targets, lse, entropy, saved, offsets = ctx.saved_tensors
    if grad_logprob is None:
        grad_logprob = torch.zeros_like(lse)
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(lse)
    # A frozen weight (LoRA's lm_head) gets no gradient: its GEMM and [V, d] buffers are skipped.
    weight_grad = ctx.needs_input_grad[1]
    gh, gw = torch.ops.fw.linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, targets,
                                                  lse, entropy, saved, offsets, ctx.temperature, ctx.save_chunk,
                                                  weight_grad)
    return gh, (gw if weight_grad else None), None, None, None


torch.library.register_autograd("fw::linear_logprob", _backward, setup_context=_setup)

# Under autocast (e.g. Lightning bf16-mixed or 16-mixed) the lm_head GEMM runs in the region's 16-bit dtype like any
# matmul: the hidden states reaching it are fp32 (the residual stream), and an fp32 GEMM over a Qwen3-sized
# vocabulary is many times slower.
register_autocast("linear_logprob")


def linear_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, save_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """(logprob [N], entropy [N] or None) of log softmax(hidden @ weight.T / temperature)[targets],
    fp32 (float64 for float64 inputs), chunked so [N, V] never exists in fp32. A negative target
    (e.g. -100) is ignored: logprob 0 and no gradient through it.

    save_logits: with bf16/fp16 operands (also under autocast) and a backward to come, keep the logits in
    float16 (2·N·V bytes, each shifted by its 256-column chunk's max) for the backward instead of
    recomputing them: one GEMM of the four fewer. Otherwise the backward recomputes them."""
    need_dim("linear_logprob", "hidden", hidden, 2, "[N, d]")
    need_dim("linear_logprob", "weight", weight, 2, f"[V, d] with d = {hidden.shape[1]}")
    need_dim("linear_logprob", "targets", targets, 1, f"[N] with N = {hidden.shape[0]}")
    need_long("linear_logprob", "targets", targets)
    if weight.shape[1] != hidden.shape[1] or targets.shape[0] != hidden.shape[0]:
        fail("linear_logprob", f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                               f"targets {tuple(targets.shape)} (expected [N, d], [V, d], [N])")
    if not temperature > 0:
        fail("linear_logprob", f"temperature must be > 0, got {temperature}")
    if weight.shape[0] == 0:
        fail("linear_logprob", "`weight` has no rows: the vocabulary must hold at least one token")
    need_device("linear_logprob", "hidden", hidden, weight=weight, targets=targets)
    save = save_logits and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lp, ent, *_ = torch.ops.fw.linear_logprob(hidden, weight, targets, float(temperature),
                                              SAVED_LOGITS_CHUNK if save else 0)
    return lp, (ent if return_entropy else None)
