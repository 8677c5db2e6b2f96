"""Step cadence: whether a periodic action (logging, checkpointing) is due."""

from __future__ import annotations


def crossed(previous: int, current: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (previous, current]: a step counter that moved from `previous`
    to `current` (possibly by several steps at once) passed a point where the action is due."""
    return current // every > previous // every
