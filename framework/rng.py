"""Random-number generator states: captured into checkpoints and restored on resume, per rank."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """torch / CUDA / Python / NumPy generator states as tensors and plain values (torch.load-safe).

    CUDA: the state of this process's current device only (`cuda_device`), restored onto the current
    device of whichever process loads it, so it follows the rank and not the device index.
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def gather_rng_states() -> list[dict[str, Any]] | None:
    """Every rank's `rng_state()` in rank order (a collective) under torch.distributed; None on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def choose_rng_state(checkpoint: dict[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """The RNG state a rank restores: its own when the checkpoint was saved by as many processes, else
    rank 0's (`fw_rng`) on every rank, as in a fresh run, where every rank is seeded alike."""
    per_rank = checkpoint.get("fw_rng_ranks")
    if per_rank is not None and len(per_rank) == world_size:
        return per_rank[rank]
    return checkpoint.get("fw_rng")
