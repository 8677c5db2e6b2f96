"""The optimizers: AdamW per optimizer role, with weight decay on matrices only."""

from __future__ import annotations

import torch


def adamw(model: torch.nn.Module, settings: dict, cfg: dict) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters: `lr` and `weight_decay` from `settings` (the role's config
    section), betas, eps and fused from `optimizer:`."""
    o = cfg["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    fused = o["fused"]
    if fused == "auto":
        # Not under 16-mixed: Lightning leaves unscaling to a fused optimizer's step, which comes after
        # fw's clipping and grad-norm metric (they need unscaled gradients).
        fused = all(p.device.type == "cuda" for p in params) and cfg["trainer"]["precision"] != "16-mixed"
    # Norms' gains (and any bias) are not decayed.
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": settings["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=settings["lr"], betas=tuple(o["betas"]),
                             eps=o["eps"], fused=bool(fused))
