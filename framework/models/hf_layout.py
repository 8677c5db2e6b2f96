"""Where each Hugging Face tensor of a model lives in a module's state dict, for checkpoint conversion."""

from __future__ import annotations

import torch

from framework.errors import FwError
from framework.models.qwen3 import HfTargets


class HfLayout:
    """Where each HF tensor of a model lives in the module's state dict (fused weights split by rows).

    Computed once on the unwrapped model, so checkpoints convert from / to any full state dict (one
    device, DDP, FSDP's gathered one) without reading the live, possibly sharded, parameters.
    `targets` (default: the model's `hf_targets()`) names the tensors to convert, e.g. only the LoRA
    adapters under PEFT's names (`framework.models.lora.peft_targets`).
    """

    def __init__(self, model: torch.nn.Module, prefix: str, targets: HfTargets | None = None):
        names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.pieces: dict[str, tuple[str, int | None, int | None]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for hf, (tensor, lo, hi) in (model.hf_targets() if targets is None else targets).items():
            key = prefix + names[id(tensor)]
            self.pieces[hf] = (key, lo, hi)
            self.shapes[key] = tuple(tensor.shape)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named views of the module's tensors, on their own devices: fw's checkpoint writer streams them
        to disk from any device before training goes on (safetensors' own writer would refuse views that
        share storage)."""
        return {hf: (state_dict[key] if lo is None else state_dict[key][lo:hi]).detach()
                for hf, (key, lo, hi) in self.pieces.items()}

    def from_hf(self, hf: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """The module's state-dict entries rebuilt from HF-named tensors; every tensor must be there."""
        missing, unexpected = sorted(set(self.pieces) - set(hf)), sorted(set(hf) - set(self.pieces))
        if missing or unexpected:
            raise FwError(f"{source}: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}")
        out: dict[str, torch.Tensor] = {}
        for name, (key, lo, hi) in self.pieces.items():
            value = hf[name]
            if key not in out:
                out[key] = torch.empty(self.shapes[key], dtype=value.dtype, device=value.device)
            dest = out[key] if lo is None else out[key][lo:hi]
            if tuple(value.shape) != tuple(dest.shape):
                raise FwError(f"{source}: tensor {name} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(value)
        return out
