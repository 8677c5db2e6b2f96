"""What `trainer.precision` and `model.policy.dtype` make of the weights: the dtype a `-true` precision converts
the whole module to, the dtype autocast computes in, and the dtype of the weights the optimizers step. The
optimizer's checks and the memory plan read them here, so that they agree with what fit builds; and the
precisions a job refuses (`check_precision`, which `fw validate` and fit run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from framework.errors import FwError

if TYPE_CHECKING:
    from framework.recipe import Requirements

# Lightning's *-true precisions convert the whole module (policy, adapters, value and reference) to their dtype.
CONVERTS_TO = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
AUTOCAST_TO = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


def trained_dtype(cfg: dict) -> str:
    """The dtype of every weight the optimizers step: a `-true` precision's, else float32 under LoRA (the adapters,
    and PPO's critic, which framework/module.py builds in float32 then), else `model.policy.dtype`."""
    policy = cfg["model"]["policy"]
    converted = CONVERTS_TO.get(cfg["trainer"]["precision"])
    return converted or ("float32" if policy["lora"] is not None else policy["dtype"] or "float32")


def check_precision(cfg: dict, requirements: Requirements, machine: bool = True) -> None:
    """Refuse precision settings that would run but compute the wrong thing. `machine`: this machine runs the job
    (accelerator auto means what it has); else only an explicit accelerator: cpu counts as the CPU."""
    import torch

    from framework.config import uses_cuda

    t = cfg["trainer"]
    if uses_cuda(t) and t["precision"] == "64-true":
        raise FwError("trainer.precision: 64-true runs on the CPU only (the CUDA kernels take bf16, fp16 and "
                      "fp32); set trainer.accelerator: cpu or another precision")
    if t["precision"] == "16-mixed" and cfg["optimizer"]["fused"] is True:
        raise FwError("optimizer.fused: true cannot be combined with trainer.precision: 16-mixed (a fused "
                      "AdamW unscales inside its step, after fw clips the gradients); use auto or false")
    why = requirements.unsupported_precisions.get(t["precision"])
    if why is not None:
        raise FwError(f"trainer.precision: {t['precision']} is not supported by recipe {cfg['recipe']} ({why})")
    on_cpu = t["accelerator"] == "cpu" or (machine and t["accelerator"] == "auto" and not uses_cuda(t)
                                           and not torch.backends.mps.is_available())
    if on_cpu and t["precision"] == "16-mixed":   # Lightning would train in bf16-mixed, with a warning only
        raise FwError("trainer.precision: 16-mixed (float16 autocast) does not run on the CPU, where Lightning "
                      "would train in bf16-mixed instead; set trainer.precision: bf16-mixed or 32-true")
