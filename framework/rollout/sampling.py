"""`SamplingParams`: how the rollout engine samples, built once from `rollout:` and passed whole."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from framework.errors import FwError


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
        limits = self.max_new_tokens
        if not isinstance(limits, int):
            try:   # any sequence of integers, numpy's too; stored as a tuple so the object stays hashable
                limits = tuple(n if isinstance(n, bool) else operator.index(n) for n in limits)
            except TypeError:
                limits = None
            object.__setattr__(self, "max_new_tokens", limits)
        values = [limits] if isinstance(limits, int) else limits
        if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
            raise FwError(f"sampling: max_new_tokens must be an int >= 1 or one such int per prompt, "
                          f"got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise FwError(f"sampling: temperature must be a finite number >= 0, got {self.temperature}")
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
