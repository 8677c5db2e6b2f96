"""The allocator setting of `fw fit` and the rollout handing its memory back."""

import os
import subprocess
import sys

import pytest
import torch

from framework.allocator import DEFAULT, ENV, ENV_ALL

_PROBE = ("import os; from framework.allocator import configure_allocator; "
          "print(configure_allocator()); print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
# What torch itself takes from the environment (torch 2.9 and later), after fw's configure_allocator
_IN_FORCE = ("import os, torch; from framework.allocator import configure_allocator; "
             "print(configure_allocator()); print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')); "
             "print(torch._C._accelerator_getAllocatorSettings())")
_TORCH_ONLY = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
needs_env_all = pytest.mark.skipif(not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
                                   reason="a torch that reads PYTORCH_ALLOC_CONF and reports its settings")


def _run(code: str, **values: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, ENV_ALL)}
    env.update(values)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _probe(env_value: str | None) -> list[str]:
    return _run(_PROBE, **({} if env_value is None else {ENV: env_value}))


def test_expandable_segments_by_default():
    assert _probe(None) == [DEFAULT, DEFAULT]


def test_the_users_setting_wins():
    assert _probe("max_split_size_mb:128") == ["max_split_size_mb:128", "max_split_size_mb:128"]


@needs_env_all
def test_a_setting_in_pytorch_alloc_conf_is_the_users_and_stays_in_force():
    # fw adds no PYTORCH_CUDA_ALLOC_CONF of its own, and torch keeps the user's setting
    assert _run(_IN_FORCE, PYTORCH_ALLOC_CONF="max_split_size_mb:64") == \
        ["max_split_size_mb:64", "None", "max_split_size_mb:64"]


@needs_env_all
def test_with_both_variables_fw_reports_the_one_torch_uses():
    both = {ENV_ALL: "max_split_size_mb:64", ENV: "garbage_collection_threshold:0.5"}
    (used,) = _run(_TORCH_ONLY, **both)   # torch alone, without fw
    assert used in both.values()
    assert _run(_IN_FORCE, **both) == [used, both[ENV], used]


# One row's two tokens (what a process keeps for good: cuBLAS's workspace a stream, the decode-attention counters),
# then rollouts of 256, 96, 24 and 5 rows (a decode graph each), twice. The memory reserved after the first call is
# where the rollouts must leave it, and the second round must allocate nothing the first did not.
_ROLLOUTS = """
import json, torch
from framework.models.presets import preset_config
from framework.models.qwen3 import Qwen3ForCausalLM
from framework.rollout import SamplingParams, generate
torch.manual_seed(0)
model = Qwen3ForCausalLM(preset_config("small", 512)).to("cuda", torch.bfloat16)
prompt = list(range(1, 200))
def rollouts(rows_of_each, max_new_tokens):
    for rows in rows_of_each:
        generate(model, [prompt] * rows, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0), seed=0)
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
start = rollouts([1], 2)
first, second = rollouts([256, 96, 24, 5], 64), rollouts([256, 96, 24, 5], 64)
c = model.config
kv = 2 * c.num_hidden_layers * 256 * c.num_key_value_heads * (len(prompt) + 64) * c.head_dim * 2
grown = {"reserved": second[0] - start[0], "allocated": second[1] - first[1], "kv": kv}
print(json.dumps(grown, separators=(",", ":")))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", ["", DEFAULT])
def test_rollouts_hand_their_kv_cache_and_graphs_back(setting):
    """Under the allocator's own setting and under fw's, a finished rollout's KV cache and decode graphs go back:
    each capture on a stream of its own left cuBLAS a workspace in that graph's pool, which kept the pool."""
    import json
    grown = json.loads(_run(_ROLLOUTS, **({ENV: setting} if setting else {}))[-1])
    assert grown["allocated"] == 0
    # without the hand-back the allocator keeps at least the KV cache's blocks reserved
    assert grown["reserved"] < grown["kv"] / 4
