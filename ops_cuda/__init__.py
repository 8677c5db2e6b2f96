"""fw operators: the op seam between the model / losses and the kernels (see docs/DESIGN.md)."""
from __future__ import annotations

from torch import Tensor

from ops_cuda import reference as _ref

__all__ = ["attention", "decode_attention", "linear_logprob", "rms_norm", "rope", "sample", "swiglu"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with fp32 accumulation; returns x's dtype."""
    return _ref.rms_norm(x, weight, eps)


def rope(q: Tensor, k: Tensor, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """NeoX split-half RoPE of q [B, T, Hq, D] and k [B, T, Hk, D] at positions [B, T]."""
    return _ref.rope(q, k, positions, theta)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:]."""
    return _ref.swiglu(gate_up)


def attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, scale: float) -> Tensor:
    """Causal GQA attention; with positions, a position that is not previous+1 starts a new sequence."""
    return _ref.attention(q, k, v, positions, scale)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """q [B, Hq, D] attends to k/v_cache[b, :, :lengths[b]] ([B, Hk, S, D])."""
    return _ref.decode_attention(q, k_cache, v_cache, lengths, scale)


def linear_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                   return_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax(hidden @ weight.T / temperature)[targets] (fp32 [N]) and optionally the entropy."""
    lp, ent, _ = _ref.linear_logprob(hidden, weight, targets, temperature)
    return lp, (ent if return_entropy else None)


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
           seed: int) -> tuple[Tensor, Tensor]:
    """(tokens [B], logprob fp32 [B]); logprob under the temperature-scaled full softmax."""
    return _ref.sample(logits, temperature, top_k, top_p, min_p, seed)
