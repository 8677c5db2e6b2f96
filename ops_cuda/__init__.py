"""fw operators: the op seam between the model / losses and the kernels (see docs/DESIGN.md).

Every function calls a `torch.ops.fw.*` operator: hand-written CUDA kernels on CUDA tensors (built on
first use, see `build`), the torch reference in ops_cuda/reference.py on CPU. The checks here look at
shapes and dtypes only, so they cost nothing under torch.compile.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops_cuda import library as _library  # defines torch.ops.fw.*
from ops_cuda.extension import doctor

__all__ = ["attention", "build", "decode_attention", "doctor", "linear_logprob", "rms_norm", "rope", "sample",
           "swiglu"]


def build(verbose: bool = False) -> str:
    """Compile (if needed) and load the CUDA kernels now, e.g. on rank 0 before a multi-process job;
    returns the library path. Raises with the reason if it cannot (CUDA then uses the references)."""
    return _library.load_kernels(verbose)


def _fail(op: str, what: str) -> None:
    raise ValueError(f"ops_cuda.{op}: {what}")


def _need_dim(op: str, name: str, t: Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        _fail(op, f"`{name}` must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(op, f"`{name}` must be {layout}, got shape {tuple(t.shape)}")


def _need_long(op: str, name: str, t: Tensor) -> None:
    if t.dtype != torch.int64:
        _fail(op, f"`{name}` must be int64 (LongTensor), got {t.dtype}")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with fp32 accumulation; returns x's dtype."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        _fail("rms_norm", "`x` must be a tensor [..., D]")
    _need_dim("rms_norm", "weight", weight, 1, f"[D] with D = x.shape[-1] = {x.shape[-1]}")
    if weight.shape[0] != x.shape[-1]:
        _fail("rms_norm", f"`weight` has {weight.shape[0]} elements, expected x.shape[-1] = {x.shape[-1]}")
    return torch.ops.fw.rms_norm(x, weight, float(eps))


def rope(q: Tensor, k: Tensor, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """NeoX split-half RoPE of q [B, T, Hq, D] and k [B, T, Hk, D] at positions [B, T]."""
    _need_dim("rope", "q", q, 4, "[B, T, Hq, D]")
    _need_dim("rope", "k", k, 4, "[B, T, Hk, D]")
    _need_dim("rope", "positions", positions, 2, "[B, T]")
    _need_long("rope", "positions", positions)
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or tuple(positions.shape) != tuple(q.shape[:2]):
        _fail("rope", f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                      f"{tuple(positions.shape)} (expected q [B,T,Hq,D], k [B,T,Hk,D], positions [B,T])")
    if q.shape[3] % 2:
        _fail("rope", f"head_dim must be even, got {q.shape[3]}")
    return torch.ops.fw.rope(q, k, positions, float(theta))


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:]."""
    if not isinstance(gate_up, Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        _fail("swiglu", f"`gate_up` must be a tensor [..., 2*I], got {getattr(gate_up, 'shape', gate_up)}")
    return torch.ops.fw.swiglu(gate_up)


def attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, scale: float) -> Tensor:
    """Causal GQA attention on [B, T, H, D]; with positions [B, T], a row holds several sequences:
    a position that is not previous+1 starts a new one. positions=None is plain causal (fastest)."""
    _need_dim("attention", "q", q, 4, "[B, T, Hq, D]")
    _need_dim("attention", "k", k, 4, "[B, T, Hk, D]")
    _need_dim("attention", "v", v, 4, "[B, T, Hk, D]")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        _fail("attention", f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                           "(expected k == v shapes, same B, T, D, and Hq a multiple of Hk)")
    if positions is not None:
        _need_dim("attention", "positions", positions, 2, "[B, T]")
        _need_long("attention", "positions", positions)
    return torch.ops.fw.attention(q, k, v, positions, float(scale))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """q [B, Hq, D] attends to k/v_cache[b, :, :lengths[b]] ([B, Hk, S, D]); length 0 gives zeros."""
    _need_dim("decode_attention", "q", q, 3, "[B, Hq, D]")
    _need_dim("decode_attention", "k_cache", k_cache, 4, "[B, Hk, S, D]")
    _need_dim("decode_attention", "v_cache", v_cache, 4, "[B, Hk, S, D]")
    _need_dim("decode_attention", "lengths", lengths, 1, "[B]")
    _need_long("decode_attention", "lengths", lengths)
    B, Hq, D = q.shape
    if (k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D
            or Hq % k_cache.shape[1] or lengths.shape[0] != B):
        _fail("decode_attention", f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                                  f"v_cache {tuple(v_cache.shape)}, lengths {tuple(lengths.shape)}")
    return torch.ops.fw.decode_attention(q, k_cache, v_cache, lengths, float(scale))


# Vocabulary columns per offset of the saved logits (linear_logprob with save_logits): the chunk that the CUDA
# forward reduces, a warp's in the row kernels and a column block of the Hopper kernel (kLogprobChunk in
# ops_cuda/csrc/kernels.h).
SAVED_LOGITS_CHUNK = 256


def linear_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, save_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """(logprob [N], entropy [N] or None) of log softmax(hidden @ weight.T / temperature)[targets],
    fp32 (float64 for float64 inputs), chunked so [N, V] never exists in fp32. A negative target
    (e.g. -100) is ignored: logprob 0 and no gradient through it.

    save_logits: with bf16/fp16 operands (also under autocast) and a backward to come, keep the logits in
    float16 (2·N·V bytes, each shifted by its 256-column chunk's max) for the backward instead of
    recomputing them: one GEMM of the four fewer. Otherwise the backward recomputes them."""
    _need_dim("linear_logprob", "hidden", hidden, 2, "[N, d]")
    _need_dim("linear_logprob", "weight", weight, 2, f"[V, d] with d = {hidden.shape[1]}")
    _need_dim("linear_logprob", "targets", targets, 1, f"[N] with N = {hidden.shape[0]}")
    _need_long("linear_logprob", "targets", targets)
    if weight.shape[1] != hidden.shape[1] or targets.shape[0] != hidden.shape[0]:
        _fail("linear_logprob", f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                                f"targets {tuple(targets.shape)} (expected [N, d], [V, d], [N])")
    if not temperature > 0:
        _fail("linear_logprob", f"temperature must be > 0, got {temperature}")
    if weight.shape[0] == 0:
        _fail("linear_logprob", "`weight` has no rows: the vocabulary must hold at least one token")
    save = save_logits and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lp, ent, *_ = torch.ops.fw.linear_logprob(hidden, weight, targets, float(temperature),
                                              SAVED_LOGITS_CHUNK if save else 0)
    return lp, (ent if return_entropy else None)


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
           seed: int) -> tuple[Tensor, Tensor]:
    """(tokens int64 [B], logprob fp32 [B]). Draws by Gumbel-max (Philox, keyed by `seed`) among the
    tokens top-k / top-p / min-p allow; logprob is under the temperature-scaled FULL softmax.
    temperature 0 is greedy, its logprob under the unscaled softmax."""
    _need_dim("sample", "logits", logits, 2, "[B, V]")
    if not temperature >= 0:
        _fail("sample", f"temperature must be >= 0, got {temperature}")
    if int(top_k) < 0:
        _fail("sample", f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        _fail("sample", f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not 0.0 <= min_p < 1.0:
        _fail("sample", f"min_p must be in [0, 1) (0 = off), got {min_p}")
    return torch.ops.fw.sample(logits, float(temperature), int(top_k), float(top_p), float(min_p), int(seed))
