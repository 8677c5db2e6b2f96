"""`build_policy`: the policy of a `model.policy` config section (HF directory or named preset, with or
without LoRA adapters)."""

from __future__ import annotations

import torch

from framework.errors import FwError
from framework.models.hf_io import load_pretrained, resolve_dtype
from framework.models.lora import add_adapters
from framework.models.presets import preset_config
from framework.models.qwen3 import Qwen3ForCausalLM, init_weights


def build_policy(model_cfg: dict, tokenizer, seed: int | None = None) -> Qwen3ForCausalLM:
    """Load `model_cfg["path"]` or random-init `model_cfg["preset"]` in `dtype` (null = float32) on the
    CPU; honours `lora`, `gradient_checkpointing`, `keep_logits` and `compile`. The tokenizer must fit the
    vocabulary.

    With `seed`, the random initialisation (a preset's weights, the adapters) draws from that seed alone
    and leaves the global RNG as it was: a LoRA run's preset base, which its checkpoints do not hold, is
    then rebuilt bit for bit at resume and by `fw export --merge`, whatever drew random numbers before.
    """
    path, preset, lora = model_cfg["path"], model_cfg["preset"], model_cfg["lora"]
    if (path is None) == (preset is None):
        raise FwError("model.policy: set exactly one of path (an HF checkpoint directory) or preset, "
                      f"got path={path!r}, preset={preset!r}")
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = _base(path, preset, resolve_dtype(model_cfg["dtype"]), tokenizer)
        if lora is not None:
            add_adapters(model, lora)
    model.gradient_checkpointing = model_cfg["gradient_checkpointing"]
    model.keep_logits = model_cfg["keep_logits"]
    if model_cfg["compile"]:
        model.compile()   # in place: keeps the class, its methods and the state_dict keys
    return model


def _base(path: str | None, preset: str | None, dtype: torch.dtype, tokenizer) -> Qwen3ForCausalLM:
    if path is not None:
        model = load_pretrained(path, dtype)
    else:
        config = preset_config(preset, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id)
        with torch.device("meta"):   # allocate once, in the final dtype, then initialise
            model = Qwen3ForCausalLM(config)
        model = model.to(dtype).to_empty(device="cpu")
        init_weights(model, config.initializer_range)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise FwError(f"model.policy: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                      f"vocab_size is {model.config.vocab_size}")
    return model
