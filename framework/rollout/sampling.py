"""`SamplingParams`: how the rollout engine samples, built once from `rollout:` and passed whole; `draw`, the
sampler it calls."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import ops_cuda
from framework.errors import FwError
from ops_cuda.sample import inverse_cdf, plain_mass, row_uniform53, sampling_mask

# The smallest temperature above greedy, as the schema's rollout.temperature says (a test holds them equal): below
# it a draw is greedy in all but name, and logits divided by it can overflow float32.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one `generate` call; the values are checked once, here.

    `max_new_tokens` is one limit or one per prompt. top_k 0, top_p 1, min_p 0 and no stop strings are
    "off". Behaviour logprobs are under the temperature-scaled full softmax whatever top-k / top-p / min-p
    allow; temperature 0 is greedy.
    """

    max_new_tokens: int | tuple[int, ...]
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        given = limits = self.max_new_tokens
        if not isinstance(limits, int):
            try:   # any sequence of integers, numpy's too; stored as a tuple so the object stays hashable
                limits = tuple(n if isinstance(n, bool) else operator.index(n) for n in limits)
            except TypeError:
                try:   # an integer of another type that is no sequence (numpy's)
                    limits = operator.index(limits)
                except TypeError:
                    limits = None
            object.__setattr__(self, "max_new_tokens", limits)
        values = [limits] if isinstance(limits, int) else limits
        if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
            raise FwError(f"sampling: max_new_tokens must be an int >= 1 or one such int per prompt, "
                          f"got {given!r}")
        if not (math.isfinite(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE)):
            raise FwError(f"sampling: temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got "
                          f"{self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise FwError(f"sampling: top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise FwError(f"sampling: top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise FwError(f"sampling: min_p must be in [0, 1) (0 = off), got {self.min_p}")
        stop = tuple(self.stop) if isinstance(self.stop, Sequence) and not isinstance(self.stop, str) else None
        if stop is None or any(not isinstance(s, str) or not s for s in stop):
            raise FwError(f"sampling: stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @classmethod
    def from_config(cls, rollout: dict, **changes) -> SamplingParams:
        """From the `rollout:` section of a resolved config, with `changes` (e.g. temperature=0) applied."""
        keys = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "stop")
        return cls(**{**{k: rollout[k] for k in keys}, **changes})

    @property
    def longest(self) -> int:
        """The largest number of new tokens any row may get."""
        return self.max_new_tokens if isinstance(self.max_new_tokens, int) else max(self.max_new_tokens)

    def row_limits(self, n_prompts: int) -> list[int] | None:
        """One limit per prompt when they differ by prompt (their count must match), else None."""
        if isinstance(self.max_new_tokens, int):
            return None
        if len(self.max_new_tokens) != n_prompts:
            raise FwError(f"sampling: max_new_tokens has {len(self.max_new_tokens)} limits for {n_prompts} prompts")
        return list(self.max_new_tokens)


def draw(logits: Tensor, params: SamplingParams, key: int, counters: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens int64 [B], behaviour logprobs float32 [B]) for logits [B, V]; row b's randomness is keyed by
    (key, counters[b]) only (counters int64 [B, 2]: sequence id, decode step), never by its slot in the batch.

    Both draw by the inverse CDF at one Philox uniform a row (53 bits) where top-k / top-p / min-p are off, so
    CPU and CUDA pick the same token but where rounding moves the target across a column's edge. CUDA:
    ``ops_cuda.sample``, whose filtered draw is Gumbel-max over Philox noise of every column. CPU: the inverse CDF
    over the filtered softmax too, the same distribution at a fraction of the cost of per-column noise; the
    logprob is the log of the drawn token's full-softmax probability.
    """
    T = params.temperature
    if logits.device.type != "cpu":
        return ops_cuda.sample(logits, T, params.top_k, params.top_p, params.min_p, key, counters)
    z = logits.float()
    if T == 0.0:
        tokens = z.argmax(-1)
        return tokens, (z.gather(1, tokens[:, None]).squeeze(1) - z.logsumexp(-1))
    if T != 1.0:
        z = z / T
    p = torch.softmax(z, -1)   # one fused pass a row: max, exp, sum, scale
    # a NaN logit (or a +inf) makes its whole row NaN: such rows draw from plain_mass, as the sampler's reference
    # does, so a diverged policy reaches the trainer's non-finite checks instead of failing inside the draw
    broken = p[:, 0].isnan()
    any_broken = bool(broken.any())
    if any_broken:
        p[broken] = plain_mass(z[broken])
    if params.top_k or params.top_p < 1.0 or params.min_p > 0.0:
        p.masked_fill_(~sampling_mask(z, params.top_k, params.top_p, params.min_p), 0.0)
    tokens = inverse_cdf(p, row_uniform53(key, counters))
    # masking keeps the drawn token's probability, which is under the full softmax
    logprob = p.gather(1, tokens[:, None]).squeeze(1).double().log().float()
    if any_broken:   # the full softmax's: NaN for a NaN logit, -inf beside a +inf one
        logprob[broken] = z[broken].gather(1, tokens[broken, None]).squeeze(1) - z[broken].logsumexp(-1)
    return tokens, logprob
