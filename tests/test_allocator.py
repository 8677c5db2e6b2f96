"""The allocator setting of `fw fit` and the rollout handing its memory back."""

import os
import subprocess
import sys

import pytest
import torch

from framework.allocator import DEFAULT, ENV

_PROBE = ("import os; from framework.allocator import configure_allocator; "
          "print(configure_allocator()); print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")


def _probe(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_expandable_segments_by_default():
    assert _probe(None) == [DEFAULT, DEFAULT]


def test_the_users_setting_wins():
    assert _probe("max_split_size_mb:128") == ["max_split_size_mb:128", "max_split_size_mb:128"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rollout_hands_its_kv_cache_back():
    from framework.models.presets import preset_config
    from framework.models.qwen3 import Qwen3ForCausalLM
    from framework.rollout import SamplingParams, generate

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(preset_config("small", 512)).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    rows, prompt = 256, list(range(1, 200))
    generate(model, [prompt] * rows, params, seed=0)
    c = model.config
    kv_bytes = 2 * c.num_hidden_layers * rows * c.num_key_value_heads * (len(prompt) + 64) * c.head_dim * 2
    # Without the hand-back the allocator keeps at least the KV cache's blocks reserved.
    assert torch.cuda.memory_reserved() - before < kv_bytes / 4
