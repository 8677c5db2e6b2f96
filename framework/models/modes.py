"""A model in eval mode for one pass, each of its modules handed its own training flag back after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """`model.eval()` inside; after, every module's own training flag as it was (a part the user keeps in eval mode
    stays in it, where `model.train()` would put it back in training). A callable that is no nn.Module (LoRA's
    AdaptersOff, whose adapters are off) has no mode to set."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
