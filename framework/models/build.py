"""`build_policy`: the policy of a `model.policy` config section (HF directory or named preset)."""

from __future__ import annotations

import torch

from framework.errors import FwError
from framework.models.hf_io import load_pretrained, resolve_dtype
from framework.models.presets import preset_config
from framework.models.qwen3 import Qwen3ForCausalLM, init_weights


def build_policy(model_cfg: dict, tokenizer, device: torch.device | str | None = None) -> Qwen3ForCausalLM:
    """Load `model_cfg["path"]` or random-init `model_cfg["preset"]` in `dtype` (null = float32) on `device`
    (None = the CPU); honours `gradient_checkpointing`, `keep_logits` and `compile`. The tokenizer must fit
    the vocabulary.

    Building on the training device streams the weights there without a host copy and draws a random
    init there too: the CPU's normal_ runs on one thread, which for 8B parameters takes minutes."""
    path, preset = model_cfg["path"], model_cfg["preset"]
    if (path is None) == (preset is None):
        raise FwError("model.policy: set exactly one of path (an HF checkpoint directory) or preset, "
                      f"got path={path!r}, preset={preset!r}")
    dtype = resolve_dtype(model_cfg["dtype"])
    if path is not None:
        model = load_pretrained(path, dtype, device)
    else:
        config = preset_config(preset, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id)
        with torch.device("meta"):   # allocate once, in the final dtype, then initialise
            model = Qwen3ForCausalLM(config)
        model = model.to(dtype).to_empty(device=device or "cpu")
        init_weights(model, config.initializer_range)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise FwError(f"model.policy: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                      f"vocab_size is {model.config.vocab_size}")
    model.gradient_checkpointing = model_cfg["gradient_checkpointing"]
    model.keep_logits = model_cfg["keep_logits"]
    if model_cfg["compile"]:
        model.compile()   # in place: keeps the class, its methods and the state_dict keys
    return model
