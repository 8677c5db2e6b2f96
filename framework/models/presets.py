"""Named model shapes for random-init runs (`model.policy.preset`), as HF config.json dicts."""

from __future__ import annotations

from framework.errors import FwError
from framework.models.qwen3_config import Qwen3Config

# vocab_size None = the tokenizer's vocabulary size. The qwen3-* entries are the released models'
# config.json shapes (Qwen/Qwen3-0.6B, -1.7B, -4B, -8B). tiny and small keep head_dim 64 (q width !=
# hidden, as in Qwen3) and a GQA ratio of 2: shapes the CUDA decode-attention kernel takes.
PRESETS: dict[str, dict] = {
    "tiny": {"vocab_size": None, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True},
    "small": {"vocab_size": None, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
              "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True},
    "qwen3-0.6b": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "qwen3-1.7b": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "qwen3-4b": {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "qwen3-8b": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}


def preset_config(name: str, vocab_size: int, eos_token_id: int | None = None,
                  pad_token_id: int | None = None) -> Qwen3Config:
    """The Qwen3Config of preset `name`; `vocab_size` (the tokenizer's) fills a None vocab_size."""
    if name not in PRESETS:
        raise FwError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    d = dict(PRESETS[name])
    if d["vocab_size"] is None:
        d["vocab_size"] = vocab_size
    return Qwen3Config.from_hf({**d, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id},
                               source=f"preset {name!r}")
