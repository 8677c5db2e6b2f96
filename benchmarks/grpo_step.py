"""grpo-bench-v1: wall time of one GRPO optimizer step through `fw fit` (rollout + reward + update).

The config is benchmarks/grpo_bench.yaml; the prompts and reward below plug in through
`class_path` like any user's. A random-init model never emits EOS, so every completion runs the full
256 tokens, as the benchmark's definition and TRL's figure assume (docs/BENCHMARKS.md). Timing and
summary: benchmarks/fit_timing.py.

    python -m benchmarks.grpo_step [--trainer.max_steps=4 ...]
"""
from __future__ import annotations

import hashlib
import random
import string
import sys
from pathlib import Path

from framework.tasks import Task

ALPHABET = string.ascii_letters + string.digits + " "


class RandomPrompts(Task):
    """Prompts of `length` random characters (one token each with the built-in tokenizer)."""

    def __init__(self, length: int = 116, seed: int = 0):
        super().__init__(seed)
        self.length = length

    def sample(self, index: int) -> dict:
        rng = random.Random(f"bench:{self.seed}:{index}")
        return self._make("".join(rng.choice(ALPHABET) for _ in range(self.length)), "")


class RandomReward:
    """A deterministic pseudo-random reward in [0, 1): non-zero advantages, so the update is real."""

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        digest = hashlib.sha256(f"{prompt}|{completion}".encode()).digest()
        return int.from_bytes(digest[:4], "little") / 2**32


def main(argv: list[str]) -> None:
    from benchmarks.fit_timing import main as fit_timing

    fit_timing(["--config", str(Path(__file__).with_name("grpo_bench.yaml")), *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
