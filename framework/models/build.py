"""`build_policy`: the policy of a `model.policy` config section (HF directory or named preset, with or
without LoRA adapters)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from framework.errors import FwError
from framework.models.hf_io import load_pretrained, read_config, resolve_dtype
from framework.models.lora import add_adapters
from framework.models.presets import preset_config
from framework.models.qwen3 import Qwen3ForCausalLM, RMSNorm
from framework.models.qwen3_config import Qwen3Config


def build_policy(model_cfg: dict, tokenizer, seed: int | None = None,
                 device: torch.device | str | None = None) -> Qwen3ForCausalLM:
    """Load `model_cfg["path"]` or random-init `model_cfg["preset"]` in `dtype` (null = float32) on `device`
    (None = the CPU); honours `lora`, `gradient_checkpointing`, `keep_logits` and `compile`. The tokenizer
    must fit the vocabulary. Building on the training device streams a checkpoint there without a host copy.

    With `seed`, the random initialisation (a preset's weights, the adapters) draws from that seed alone
    and leaves the global RNG as it was: a LoRA run's preset base, which its checkpoints do not hold, is
    then rebuilt bit for bit at resume and by `fw export --merge`, whatever drew random numbers before and
    on whichever device it is built (see `seeded_init`).
    """
    path, preset, lora = model_cfg["path"], model_cfg["preset"], model_cfg["lora"]
    if (path is None) == (preset is None):
        raise FwError("model.policy: set exactly one of path (an HF checkpoint directory) or preset, "
                      f"got path={path!r}, preset={preset!r}")
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = _base(path, preset, resolve_dtype(model_cfg["dtype"]), tokenizer, seed, device)
        if lora is not None:
            add_adapters(model, lora)
    model.gradient_checkpointing = model_cfg["gradient_checkpointing"]
    model.keep_logits = model_cfg["keep_logits"]
    if model_cfg["compile"]:
        model.compile()   # in place: keeps the class, its methods and the state_dict keys
    return model


def policy_config(model_cfg: dict, tokenizer) -> Qwen3Config | None:
    """The shapes `build_policy` builds for `model_cfg`, read without its weights: its path's config.json or its
    preset's; None when it sets neither (which `build_policy` refuses)."""
    if model_cfg["path"] is not None:
        return read_config(model_cfg["path"])[0]
    if model_cfg["preset"] is not None:
        return preset_config(model_cfg["preset"], tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id)
    return None


def _base(path: str | None, preset: str | None, dtype: torch.dtype, tokenizer, seed: int | None,
          device: torch.device | str | None) -> Qwen3ForCausalLM:
    if path is not None:
        model = load_pretrained(path, dtype, device)
    else:
        config = preset_config(preset, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id)
        with torch.device("meta"):   # allocate once, in the final dtype, then initialise
            model = Qwen3ForCausalLM(config)
        model = model.to(dtype).to_empty(device=device or "cpu")
        seeded_init(model, config.initializer_range,
                    int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)
    problem = vocabulary_problem(tokenizer.vocab_size, model.config)
    if problem is not None:
        raise FwError(f"model.policy: {problem}")
    return model


def vocabulary_problem(tokenizer_size: int, config: Qwen3Config) -> str | None:
    """Why a model of `config` cannot embed every id of a tokenizer of `tokenizer_size` tokens, or None (the
    policy's, the reference's and the critic's check, in `fw validate` and when fit builds them)."""
    if tokenizer_size > config.vocab_size:
        return f"the tokenizer has {tokenizer_size} tokens but the model's vocab_size is {config.vocab_size}"
    return None


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seeded_init(model: nn.Module, std: float, seed: int) -> None:
    """HF's initialisation (normal(0, std) linear and embedding weights, zero biases, unit norms), each
    tensor drawn on the CPU from its own generator seeded by (seed, its name), on parallel threads.

    The values are a function of `seed` alone, whatever the device, dtype or thread order: a preset base
    drawn on the GPU is redrawn identically on a CPU-only machine. The CPU's normal_ runs on one thread
    per call, so one call per tensor across threads is what makes an 8B init take seconds, not minutes.
    """
    draws, constants = [], []
    for prefix, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            draws.append((f"{prefix}.weight", m.weight))
            if getattr(m, "bias", None) is not None:
                constants.append((m.bias, 0.0))
        elif isinstance(m, RMSNorm):
            constants.append((m.weight, 1.0))

    def draw(item: tuple[str, torch.Tensor]) -> None:
        name, weight = item
        host = torch.empty(weight.shape, dtype=torch.float32)
        host.normal_(0.0, std, generator=torch.Generator().manual_seed(_tensor_seed(seed, name)))
        with torch.no_grad():
            weight.copy_(host)

    with torch.no_grad():
        for tensor, value in constants:
            tensor.fill_(value)
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(draw, draws))
