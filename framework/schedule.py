"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

from framework.config import defaults


class LRSchedule:
    """LR multiplier after `step` optimizer steps: linear warmup over `warmup_steps`, then `name` (constant,
    linear or cosine) decays to `min_lr_ratio` at `total_steps`."""

    def __init__(self, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.name, self.warmup_steps, self.total_steps, self.min_lr_ratio = (
            name, warmup_steps, total_steps, min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        decay = 1.0 - progress if self.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def schedule_problems(cfg: dict) -> list[str]:
    """`scheduler.min_lr_ratio` set off its schema default while `scheduler.name` is constant, which never decays to
    it: one `key: message` line (it would change nothing), else none."""
    s = cfg["scheduler"]
    default = defaults(cfg["recipe"])["scheduler"]["min_lr_ratio"]
    if s["name"] == "constant" and s["min_lr_ratio"] != default:
        return [(f"scheduler.min_lr_ratio: {s['min_lr_ratio']} changes nothing while scheduler.name is constant; set "
                 f"name: linear or cosine to decay the lr to it, or leave min_lr_ratio at {default}")]
    return []
