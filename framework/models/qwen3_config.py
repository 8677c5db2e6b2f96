"""`Qwen3Config`: the shape of a Qwen3 dense model, read from and written to HF `config.json`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from framework.errors import FwError

# config.json keys that describe features this implementation does not have. A checkpoint that turns
# any of them on is refused instead of being loaded as a plain dense model with wrong numerics.
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts",
             "num_local_experts", "shared_expert_intermediate_size")
_HF_SLIDING_WINDOW = 4096   # transformers' Qwen3Config default
_HF_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads")


def _plain_rope(settings: object) -> bool:
    """Whether a rope_scaling / rope_parameters value is plain RoPE: {"rope_type": "default"} (or the older
    "type" key), optionally with rope_theta; transformers computes those as no scaling at all."""
    return (isinstance(settings, dict) and settings.get("rope_type", settings.get("type", "default")) == "default"
            and not set(settings) - {"rope_type", "type", "rope_theta"})


@dataclass
class Qwen3Config:
    """Hyper-parameters of a Qwen3 dense decoder (field names are HF's config.json names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6          # HF Qwen3Config's defaults for keys a config.json may omit
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in _REQUIRED + ("head_dim",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FwError(f"Qwen3 config: {name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise FwError(f"Qwen3 config: {name} must be a finite number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):   # the string "false" would read as true
            raise FwError(f"Qwen3 config: tie_word_embeddings must be true or false, got "
                          f"{self.tie_word_embeddings!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FwError(f"Qwen3 config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                          f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise FwError(f"Qwen3 config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise FwError(f"Qwen3 config: rms_norm_eps and rope_theta must be > 0, got "
                          f"{self.rms_norm_eps!r} and {self.rope_theta!r}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> Qwen3Config:
        """Validate an HF config dict and keep what the model needs; unsupported features raise FwError."""
        where = f"{source}:"
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise FwError(f"{where} model_type is {model_type!r}; only dense Qwen3 ('qwen3') is supported")
        unsupported = []
        if d.get("attention_bias"):
            unsupported.append("attention_bias: true (Qwen3 has no attention biases)")
        if d.get("mlp_bias"):
            unsupported.append("mlp_bias: true")
        layer_types = d.get("layer_types")
        # transformers windows the layers from max_window_layers on, when use_sliding_window sets a window; a
        # window or max_window_layers that config.json leaves out is transformers' default (a null one: refused)
        first_windowed = d.get("max_window_layers", _HF_MAX_WINDOW_LAYERS)
        windowed = (d.get("use_sliding_window") and d.get("sliding_window", _HF_SLIDING_WINDOW) is not None
                    and (first_windowed or 0) < (d.get("num_hidden_layers") or 0))
        if layer_types is None and windowed:
            unsupported.append("use_sliding_window: true (sliding-window attention is not implemented)")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            unsupported.append(f"layer_types other than full_attention: {sorted(set(layer_types))}")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):   # transformers' two names of one function
            unsupported.append(f"hidden_act: {d['hidden_act']!r} (only 'silu' is implemented)")
        if d.get("attention_dropout"):
            unsupported.append(f"attention_dropout: {d['attention_dropout']!r} (attention has no dropout here)")
        if d.get("quantization_config") is not None:
            method = d["quantization_config"].get("quant_method") if isinstance(d["quantization_config"], dict) \
                else None
            unsupported.append(f"quantization_config ({method or 'present'}: quantised weights are not supported; "
                               "give a bf16, fp16 or fp32 checkpoint)")
        for key in _MOE_KEYS:
            if d.get(key):
                unsupported.append(f"{key}: {d[key]!r} (mixture-of-experts models are not supported)")
        scaling = d.get("rope_scaling")
        if scaling is not None and not _plain_rope(scaling):
            unsupported.append(f"rope_scaling: {scaling!r} (only plain RoPE is implemented)")
        rope_theta = d.get("rope_theta")
        if isinstance(scaling, dict):
            rope_theta = scaling.get("rope_theta", rope_theta)
        params = d.get("rope_parameters")
        if params is not None:   # transformers >= 5 writes RoPE settings here
            if not _plain_rope(params):
                unsupported.append(f"rope_parameters: {params!r} (only plain RoPE is implemented)")
            elif "rope_theta" in params:
                rope_theta = params["rope_theta"]
        if unsupported:
            raise FwError(f"{where} unsupported Qwen3 configuration: " + "; ".join(unsupported))
        # a null num_key_value_heads means one kv head per attention head (multi-head attention), as transformers'
        # Qwen3Config reads it; any other required key that is null is as good as missing
        missing = [k for k in _REQUIRED if d.get(k) is None and not (k == "num_key_value_heads" and k in d)]
        if missing:
            raise FwError(f"{where} missing required keys {missing} (absent or null)")
        known = {f.name for f in fields(cls)}
        kwargs = {k: d[k] for k in known if d.get(k) is not None and k != "rope_theta"}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        if rope_theta is not None:
            if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)):
                raise FwError(f"{where} rope_theta must be a number, got {rope_theta!r}")
            kwargs["rope_theta"] = float(rope_theta)
        # transformers' Qwen3Config defaults head_dim to 128 (not hidden_size // heads) when config.json
        # leaves it out; the model must be the one HF would build from the same file.
        kwargs.setdefault("head_dim", 128)
        try:
            return cls(**kwargs)
        except FwError as e:
            raise FwError(f"{where} {e}") from None

    def to_hf(self, dtype: str | None = None) -> dict:
        """The config.json dict, in the layout of the released Qwen3 checkpoints."""
        d = asdict(self)
        d.update({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "max_window_layers": self.num_hidden_layers,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "use_cache": True,
        })
        if dtype is not None:
            d["torch_dtype"] = dtype
        return dict(sorted(d.items()))
