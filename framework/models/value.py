"""`Qwen3ValueModel`: the PPO critic, a Qwen3 trunk with a scalar head, saved as its own safetensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.models.qwen3 import (
    HfTargets,
    Packing,
    Qwen3ForCausalLM,
    Qwen3Model,
    SharedPrompts,
    checkpointing_mode,
    init_weights,
    load_targets,
    target_views,
)
from framework.models.qwen3_config import Qwen3Config

ARCHITECTURE = "Qwen3ValueModel"   # config.json "architectures" entry that marks a value model directory


class Qwen3ValueModel(nn.Module):
    """Trunk + `v_head` Linear(hidden, 1), zero-initialised so that V = 0 before any training."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.v_head = nn.Linear(config.hidden_size, 1)
        init_weights(self.model, config.initializer_range)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    @property
    def gradient_checkpointing(self) -> bool | str:
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, mode: bool | str) -> None:
        self.model.gradient_checkpointing = checkpointing_mode(mode)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                packing: Packing | SharedPrompts | None = None) -> Tensor:
        """Values [B, T] in float32, or float64 for a float64 trunk (the head runs in at least fp32 whatever the
        trunk's dtype, also under autocast; `packing`: see Qwen3Model.forward)."""
        h = self.model(input_ids, position_ids, packing=packing)
        dtype = torch.promote_types(h.dtype, torch.float32)
        with torch.autocast(h.device.type, enabled=False):   # autocast would run the head's matmul in 16 bits
            return F.linear(h.to(dtype), self.v_head.weight.to(dtype), self.v_head.bias.to(dtype)).squeeze(-1)

    @classmethod
    def from_policy(cls, policy: Qwen3ForCausalLM, dtype: torch.dtype | None = None) -> Qwen3ValueModel:
        """A critic whose trunk is a copy of the policy's (in `dtype`, None = the policy's; same device), head
        zero. Gradient checkpointing is off: the caller sets it."""
        ref = policy.lm_head_weight
        with torch.device("meta"):
            value = cls(policy.config)
        value = value.to(dtype or ref.dtype).to_empty(device=ref.device)
        value.model.load_state_dict(policy.model.state_dict())
        with torch.no_grad():
            value.v_head.weight.zero_()
            value.v_head.bias.zero_()
        return value

    def hf_targets(self) -> HfTargets:
        t = self.model.hf_targets()
        t["v_head.weight"] = (self.v_head.weight, None, None)
        t["v_head.bias"] = (self.v_head.bias, None, None)
        return t

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Trunk tensors under HF's names plus `v_head.weight` / `v_head.bias`."""
        return target_views(self.hf_targets())

    def load_hf_state_dict(self, sd: dict[str, Tensor], strict: bool = True) -> None:
        load_targets(self.hf_targets(), sd, strict)
