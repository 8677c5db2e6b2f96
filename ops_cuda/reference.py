"""Torch reference implementations of every fw operator (forward and backward).

These are the CPU kernels of `torch.ops.fw.*` and the CUDA fallback when the extension cannot build.
They compute in float32 (float64 for float64 inputs, so gradcheck works) and return the input dtype
unless the operator's contract says otherwise. The CUDA kernels in csrc/ implement the same formulas.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows of the [rows, V] float32 logits tile that linear_logprob holds at once: bounded bytes, any vocab.
LOGITS_TILE_BYTES = 1 << 28


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of `dtype`: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------- rms_norm
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(acc)).to(x.dtype)


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(x.dtype)
    xf, gf, wf = x.to(acc), grad.to(acc), weight.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gw = gf * wf
    # d/dx of x*rstd: rstd*g - x*rstd^3*mean(g*x)
    gx = rstd * gw - xf * rstd.pow(3) * (gw * xf).mean(-1, keepdim=True)
    gweight = (gf * xf * rstd).reshape(-1, x.shape[-1]).sum(0)
    return gx.to(x.dtype), gweight.to(weight.dtype)


# ---------------------------------------------------------------- rope
def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """float32 inverse frequencies, computed as transformers' Qwen3 rotary embedding does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, D/2] in float32; the angle is the float32 product position * inv_freq (as in HF)."""
    angle = positions.to(torch.float32)[..., None] * rope_inv_freq(head_dim, theta).to(positions.device)
    return angle.cos(), angle.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    acc = acc_dtype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    c, s = cos[:, :, None, :].to(acc), sin[:, :, None, :].to(acc)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope(q: Tensor, k: Tensor, positions: Tensor, theta: float, inverse: bool = False) -> tuple[Tensor, Tensor]:
    """NeoX split-half rotary embedding of q [B,T,Hq,D] and k [B,T,Hk,D]; `inverse` rotates by -angle
    (the backward: the rotation is orthogonal, so its gradient is the inverse rotation)."""
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
    if inverse:
        sin = -sin
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# ---------------------------------------------------------------- swiglu
def swiglu(gate_up: Tensor) -> Tensor:
    acc = acc_dtype(gate_up.dtype)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def swiglu_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    acc = acc_dtype(gate_up.dtype)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    g = grad.to(acc)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat([dgate, g * silu], dim=-1).to(gate_up.dtype)


# ---------------------------------------------------------------- attention
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


def attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, scale: float) -> Tensor:
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


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float) -> Tensor:
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


# ---------------------------------------------------------------- linear + logprob
def chunk_rows(n: int, vocab: int) -> int:
    return max(1, min(n, LOGITS_TILE_BYTES // (4 * max(vocab, 1))))


def saves_logits(dtype: torch.dtype, save_chunk: int) -> bool:
    """Whether linear_logprob keeps its shifted logits for the backward: asked for (save_chunk > 0) and
    16-bit operands, whose gradient GEMMs round dz to 16 bits anyway; fp32 and fp64 always recompute."""
    return save_chunk > 0 and dtype in (torch.bfloat16, torch.float16)


# float16's largest finite magnitude: a shifted logit below -65504 is stored as -65504 (its exp is 0 anyway).
FP16_MIN = -65504.0


def linear_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
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


def linear_logprob_backward(grad_logprob: Tensor, grad_entropy: Tensor, hidden: Tensor, weight: Tensor,
                            targets: Tensor, lse: Tensor, entropy: Tensor, saved: Tensor, offsets: Tensor,
                            temperature: float, save_chunk: int = 0) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight) from the saved shifted logits when the forward kept them (saved
    non-empty), else recomputing the logits chunk by chunk.
    d logprob/dz = onehot - p; d entropy/dz = -p (log p + H); z = logits / temperature."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    wf = weight.to(acc)
    gh = torch.empty_like(hidden)
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
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
        gw += g.T @ hc
    return gh, gw.to(weight.dtype)


# ---------------------------------------------------------------- sampler
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int, rounds: int = 10):
    """Philox4x32 (Random123) on int64 tensors holding uint32 values; returns the 4 output words."""
    c = [x & _MASK32 for x in (c0, c1, c2, c3)]
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0, p1 = c[0] * _PHILOX_M[0], c[2] * _PHILOX_M[1]  # int64 wraps; the masks recover the uint64 words
        hi0, lo0 = (p0 >> 32) & _MASK32, p0 & _MASK32
        hi1, lo1 = (p1 >> 32) & _MASK32, p1 & _MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def gumbel_noise(batch: int, vocab: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """float32 [batch, vocab] Gumbel(0, 1) noise from Philox4x32-10 with key = seed (64 bit) and
    counter (col // 4, row, 0, 0), output word col % 4; u = ((x >> 9) + 0.5) * 2^-23."""
    groups = (vocab + 3) // 4
    c0 = torch.arange(groups, device=device, dtype=torch.int64)[None, :].expand(batch, groups)
    c1 = torch.arange(batch, device=device, dtype=torch.int64)[:, None].expand(batch, groups)
    zero = torch.zeros_like(c0)
    words = philox4x32(c0, c1, zero, zero, seed & _MASK32, (seed >> 32) & _MASK32)
    x = torch.stack(words, dim=-1).reshape(batch, 4 * groups)[:, :vocab]  # column 4g + j = word j of group g
    u = ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(u))


def sampling_mask(z: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Tokens that may be drawn from scaled logits z [B, V] (float32): z >= max(tau_k, tau_p, tau_min).
    tau_k = the k-th largest z; tau_p = the largest value whose tail {z >= tau} (within top-k) holds at
    least top_p of the top-k mass; tau_min = max z + log(min_p). Ties at a threshold are all kept."""
    B, V = z.shape
    tau = torch.full((B,), float("-inf"), dtype=z.dtype, device=z.device)
    zmax = z.max(-1).values
    if 0 < top_k < V:
        tau = torch.maximum(tau, z.topk(top_k, dim=-1).values[:, -1])
    if top_p < 1.0:
        e = torch.where(z >= tau[:, None], (z - zmax[:, None]).exp(), 0.0)
        s, order = z.sort(dim=-1, descending=True)
        cum = e.gather(1, order).cumsum(-1)
        need = top_p * e.sum(-1, keepdim=True)
        idx = (cum < need).sum(-1, keepdim=True).clamp(max=V - 1)
        tau = torch.maximum(tau, s.gather(1, idx).squeeze(1))
    if min_p > 0.0:
        tau = torch.maximum(tau, zmax + torch.tensor(math.log(min_p), dtype=z.dtype))
    return z >= tau[:, None]


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
           seed: int) -> tuple[Tensor, Tensor]:
    """(tokens int64 [B], logprob float32 [B]). Gumbel-max over the allowed tokens of logits/temperature;
    logprob under the temperature-scaled FULL softmax. temperature 0: greedy (first maximum), logprob
    under the unscaled softmax."""
    z = logits.to(acc_dtype(logits.dtype))
    if temperature == 0.0:
        tokens = z.argmax(-1)
    else:
        z = z / temperature
        keep = sampling_mask(z, top_k, top_p, min_p)
        g = gumbel_noise(z.shape[0], z.shape[1], seed, z.device).to(z.dtype)
        tokens = torch.where(keep, z + g, float("-inf")).argmax(-1)
    logprob = z.gather(1, tokens[:, None]).squeeze(1) - z.logsumexp(-1)
    return tokens, logprob.to(torch.float32)
