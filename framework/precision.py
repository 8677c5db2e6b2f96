"""What `trainer.precision` and `model.policy.dtype` make of the weights: the dtype a `-true` precision converts
the whole module to, the dtype autocast computes in, and the dtype of the weights the optimizers step. The
optimizer's checks and the memory plan read them here, so that they agree with what fit builds."""

from __future__ import annotations

# Lightning's *-true precisions convert the whole module (policy, adapters, value and reference) to their dtype.
CONVERTS_TO = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
AUTOCAST_TO = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


def trained_dtype(cfg: dict) -> str:
    """The dtype of every weight the optimizers step: a `-true` precision's, else float32 under LoRA (the adapters,
    and PPO's critic, which framework/module.py builds in float32 then), else `model.policy.dtype`."""
    policy = cfg["model"]["policy"]
    converted = CONVERTS_TO.get(cfg["trainer"]["precision"])
    return converted or ("float32" if policy["lora"] is not None else policy["dtype"] or "float32")
