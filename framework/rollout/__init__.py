"""Rollout engine: generation over a paged KV cache with behaviour logprobs, and its `SamplingParams`."""

from framework.rollout.engine import FINISH_REASONS, Rollout, RolloutEngine, generate, step_seed, stop_token_ids
from framework.rollout.kv_cache import CacheSettings
from framework.rollout.sampling import SamplingParams

__all__ = ["FINISH_REASONS", "CacheSettings", "Rollout", "RolloutEngine", "SamplingParams", "generate", "step_seed",
           "stop_token_ids"]
