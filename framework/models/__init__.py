"""Qwen3 policy and value models, HF checkpoint IO, presets and the KV cache."""

from framework.models.build import build_policy
from framework.models.hf_io import load_pretrained, load_value_model, save_pretrained, save_value_model
from framework.models.presets import PRESETS
from framework.models.qwen3 import KVCache, Packing, PagedBatch, PagedKVCache, Qwen3ForCausalLM, SharedPrompts
from framework.models.qwen3_config import Qwen3Config
from framework.models.value import Qwen3ValueModel

__all__ = [
           "PRESETS",
           "KVCache",
           "Packing",
           "PagedBatch",
           "PagedKVCache",
           "Qwen3Config",
           "Qwen3ForCausalLM",
           "Qwen3ValueModel",
           "SharedPrompts",
           "build_policy",
           "load_pretrained",
           "load_value_model",
           "save_pretrained",
           "save_value_model",
]
