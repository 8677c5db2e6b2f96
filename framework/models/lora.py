"""LoRA adapters on a Qwen3ForCausalLM (`model.policy.lora`), under PEFT's names and file format.

Each targeted projection (PEFT's module names: q_proj ... down_proj) gets `scaling * B @ A` with
`scaling = alpha / rank`, A `[rank, in]` and B `[out, rank]`, initialised as PEFT does (A Kaiming-uniform,
B zero: the adapted model starts equal to the base). The fused weights hold several HF projections
(qkv_proj = q, k, v rows; gate_up_proj = gate, up rows): their `LoraLinear` adds each adapter's output
to that projection's output columns only, so the others see the plain base weight.

The base weights stay frozen (requires_grad False) in `model.policy.dtype` (bf16 is the intended dtype for big
models: frozen weights need neither an fp32 master copy nor optimizer state); the adapters are float32 (unless a
`-true` precision converts the whole module) and compute in their own dtype outside autocast, as PEFT does. Rollouts
run the adapters as extra low-rank matmuls (no merge: the base weights are never rewritten, so a bf16 base cannot
drift); `merged_copy` builds a separate merged model for export and for measuring merged decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.errors import FwError
from framework.models.hf_io import empty_model
from framework.models.qwen3 import HfTargets, Qwen3ForCausalLM
from framework.models.qwen3_config import Qwen3Config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def projections(config: Qwen3Config) -> dict[str, tuple[str, int, int]]:
    """PEFT module name -> (the fused module holding it, inside a decoder layer; its output rows lo..hi-1)."""
    c = config
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    return {
        "q_proj": ("self_attn.qkv_proj", 0, q),
        "k_proj": ("self_attn.qkv_proj", q, q + kv),
        "v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "o_proj": ("self_attn.o_proj", 0, c.hidden_size),
        "gate_proj": ("mlp.gate_up_proj", 0, inter),
        "up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
        "down_proj": ("mlp.down_proj", 0, c.hidden_size),
    }


def hf_module(name: str) -> str:
    """The HF module path of a PEFT target inside a decoder layer (self_attn.q_proj, mlp.up_proj, ...)."""
    return ("self_attn." if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + name


class LoraLinear(nn.Module):
    """A frozen `nn.Linear` (`base_layer`) plus one adapter per HF projection it holds.

    `rows[name] = (lo, hi)`: adapter `name` adds `scaling * B @ A` to output rows lo..hi-1 only.
    """

    def __init__(self, base_layer: nn.Linear, rows: dict[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float):
        super().__init__()
        self.base_layer = base_layer
        self.rows = dict(sorted(rows.items(), key=lambda item: item[1][0]))   # in output-row order
        self.rank, self.alpha, self.dropout_p = rank, alpha, dropout
        self.scaling = alpha / rank
        self.enabled = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base_layer.weight.device
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(rank, base_layer.in_features, device=device))
                                        for n in self.rows})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(hi - lo, rank, device=device))
                                        for n, (lo, hi) in self.rows.items()})
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))   # PEFT's init of lora_A

    @property
    def weight(self) -> Tensor:
        return self.base_layer.weight

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: Tensor) -> Tensor:
        y = self.base_layer(x)
        return y + self.delta(x).to(y.dtype) if self.enabled else y

    def delta(self, x: Tensor) -> Tensor:
        """The adapters' contribution to the output, zero in the rows no adapter covers."""
        names = list(self.rows)
        autocast = torch.is_autocast_enabled(x.device.type)   # under autocast the matmuls pick their own dtype

        def dropped(a: Tensor) -> Tensor:
            h = self.dropout(x)
            return h if autocast else h.to(a.dtype)

        if self.training and self.dropout_p > 0 and len(names) > 1:
            # each adapter draws its own dropout mask, as PEFT's separate modules (q_proj, k_proj, ...) do
            us = [F.linear(dropped(self.lora_A[n]), self.lora_A[n]) for n in names]
        else:
            # One matmul for every A of this layer (they share the input), then one per B.
            a = self.lora_A[names[0]] if len(names) == 1 else torch.cat([self.lora_A[n] for n in names])
            us = F.linear(dropped(a), a).split(self.rank, dim=-1)
        parts, row = [], 0
        for u, name in zip(us, names, strict=True):
            lo, hi = self.rows[name]
            if lo > row:
                parts.append(u.new_zeros(*u.shape[:-1], lo - row))
            parts.append(F.linear(u, self.lora_B[name]))
            row = hi
        if row < self.out_features:
            parts.append(u.new_zeros(*u.shape[:-1], self.out_features - row))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out * self.scaling

    def merged_rows(self, name: str) -> Tensor:
        """`scaling * B @ A` of adapter `name` in float32, [hi - lo, in]."""
        return (self.lora_B[name].float() @ self.lora_A[name].float()) * self.scaling


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, leaf = path.split(".")
    for p in parents:
        root = getattr(root, p)
    return root, leaf


def add_adapters(model: Qwen3ForCausalLM, lora: dict) -> Qwen3ForCausalLM:
    """Freeze every base weight and give the projections in `lora["targets"]` adapters (in place).

    `lora` is a resolved `model.policy.lora` section: rank, alpha, dropout, targets.
    """
    if has_adapters(model):
        raise FwError("add_adapters: the model already has LoRA adapters")
    where = projections(model.config)
    unknown = [name for name in lora["targets"] if name not in where]
    if unknown:   # the schema refuses these; a section built by hand reaches here unchecked
        raise FwError(f"add_adapters: {', '.join(map(repr, unknown))} is not a LoRA target; the targets are PEFT's "
                      f"module names: {', '.join(where)}")
    model.requires_grad_(False)
    modules: dict[str, dict[str, tuple[int, int]]] = {}
    for name in lora["targets"]:
        module, lo, hi = where[name]
        modules.setdefault(module, {})[name] = (lo, hi)
    for layer in model.model.layers:
        for path, rows in modules.items():
            parent, leaf = _parent(layer, path)
            setattr(parent, leaf, LoraLinear(getattr(parent, leaf), rows, lora["rank"], lora["alpha"],
                                             lora["dropout"]))
    return model


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """(qualified name, module) of every `LoraLinear` in `model`."""
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            yield name, m


def has_adapters(model: nn.Module) -> bool:
    return any(True for _ in lora_modules(model))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside: `model` computes its base (every adapter skipped); the previous switches come back after."""
    modules = [m for _, m in lora_modules(model)]
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, enabled in zip(modules, before):
            m.enabled = enabled


@contextmanager
def adapters_detached(model: nn.Module) -> Iterator[None]:
    """Inside: every `LoraLinear` is replaced by its base `nn.Linear`, so `model.state_dict()` is the base's."""
    swapped = []
    for name, m in list(lora_modules(model)):
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, m.base_layer)
        swapped.append((parent, leaf, m))
    try:
        yield
    finally:
        for parent, leaf, m in swapped:
            setattr(parent, leaf, m)


def _layer_modules(model: Qwen3ForCausalLM) -> Iterator[tuple[int, LoraLinear]]:
    for i, layer in enumerate(model.model.layers):
        for _, m in lora_modules(layer):
            yield i, m


def peft_targets(model: Qwen3ForCausalLM) -> HfTargets:
    """PEFT's tensor names (`base_model.model.<HF module>.lora_A.weight` / `lora_B.weight`) -> the adapters."""
    t: HfTargets = {}
    for i, m in _layer_modules(model):
        for name in m.rows:
            key = f"{PEFT_PREFIX}model.layers.{i}.{hf_module(name)}"
            t[f"{key}.lora_A.weight"] = (m.lora_A[name], None, None)
            t[f"{key}.lora_B.weight"] = (m.lora_B[name], None, None)
    return t


def lora_settings(model: Qwen3ForCausalLM) -> dict:
    """rank, alpha, dropout and targets of the model's adapters (what `add_adapters` was given)."""
    modules = [m for _, m in lora_modules(model)]
    if not modules:
        raise FwError("the model has no LoRA adapters")
    m = modules[0]
    targets = [n for n in projections(model.config) if any(n in x.rows for x in modules)]
    return {"rank": m.rank, "alpha": m.alpha, "dropout": m.dropout_p, "targets": targets}


def adapter_config(model: Qwen3ForCausalLM, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for the model's adapters; `base_model` = the base's path (None for a preset)."""
    s = lora_settings(model)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": s["rank"], "lora_alpha": s["alpha"], "lora_dropout": s["dropout"], "target_modules": s["targets"],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def check_adapter_config(saved: dict, lora: dict, source: str) -> None:
    """Refuse adapters saved with other settings than the config's `model.policy.lora` section."""
    got = {"rank": saved.get("r"), "alpha": saved.get("lora_alpha"), "targets": sorted(saved.get("target_modules")
                                                                                        or [])}
    want = {"rank": lora["rank"], "alpha": lora["alpha"], "targets": sorted(lora["targets"])}
    diff = [f"{k} {got[k]!r} (config: {want[k]!r})" for k in want if got[k] != want[k]]
    if saved.get("peft_type") != "LORA" or diff:
        raise FwError(f"{source}: adapters saved with other settings than model.policy.lora: "
                      f"{', '.join(diff) or 'peft_type ' + repr(saved.get('peft_type'))}")


def merged_hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, Tensor]:
    """The base's HF-named tensors with every adapter folded in (W + scaling * B @ A in float32, then the
    base dtype); new tensors: the model's own weights are not touched."""
    sd = {k: v.detach().clone() for k, v in model.hf_state_dict().items()}
    for i, m in _layer_modules(model):
        for name in m.rows:
            key = f"model.layers.{i}.{hf_module(name)}.weight"
            sd[key] = (sd[key].float() + m.merged_rows(name)).to(sd[key].dtype)
    return sd


def merged_copy(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """A separate plain Qwen3ForCausalLM (no adapters) holding the merged weights, in the base's dtype and device."""
    ref = model.lm_head_weight
    merged = empty_model(Qwen3ForCausalLM, model.config, ref.dtype, ref.device)
    merged.load_hf_state_dict(merged_hf_state_dict(model))
    return merged.eval()


class AdaptersOff:
    """The base model of an adapted policy, sharing its weights: the KL reference under LoRA.

    Not an nn.Module, so its weights (the policy's) are neither registered twice nor saved; every forward
    runs the policy with its adapters switched off.
    """

    def __init__(self, policy: Qwen3ForCausalLM):
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)

    @property
    def config(self) -> Qwen3Config:
        return self.policy.config

    @property
    def lm_head_weight(self) -> Tensor:
        return self.policy.lm_head_weight

    @property
    def saves_logits(self) -> bool:
        return self.policy.saves_logits

    def eval(self) -> AdaptersOff:
        return self
