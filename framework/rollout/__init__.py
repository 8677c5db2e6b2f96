"""Rollout engine: batched KV-cache generation with behaviour logprobs, and its `SamplingParams`."""

from framework.rollout.engine import FINISH_REASONS, Rollout, generate, step_seed, stop_token_ids
from framework.rollout.sampling import SamplingParams

__all__ = ["FINISH_REASONS", "Rollout", "SamplingParams", "generate", "step_seed", "stop_token_ids"]
