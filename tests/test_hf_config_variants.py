"""Model directories that transformers reads as plain Qwen3 load with its logits; what fw would compute otherwise
than transformers (quantised weights, attention dropout, two weight sets, a malformed index) is refused in one
line naming the cause."""

import json

import pytest
import torch
import transformers
from test_hf_parity import VOCAB, hf_logits, hf_model

from framework.errors import FwError
from framework.models import load_pretrained


def edit_config(path, **changes) -> None:
    """config.json with `changes`; without the layer_types transformers wrote, so that it derives them again."""
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes", [
    {"hidden_act": "swish"},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},   # every layer below the window's
], ids=["swish", "window-above-the-layers"])
def test_configs_transformers_computes_as_plain_qwen3_load_with_its_logits(tmp_path, changes):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    edit_config(tmp_path, **changes)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(ref, ids)
    with torch.no_grad():
        got = load_pretrained(tmp_path)(ids)
    assert expected.std() > 1.0
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("changes,message", [
    ({"attention_dropout": 0.1}, "attention_dropout: 0.1 (attention has no dropout here)"),
    ({"quantization_config": {"quant_method": "fp8"}},
     "quantization_config (fp8: quantised weights are not supported; give a bf16, fp16 or fp32 checkpoint)"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "use_sliding_window: true (sliding-window attention is not implemented)"),
])
def test_configs_fw_would_compute_otherwise_are_refused(tmp_path, changes, message):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(FwError, match=r"unsupported Qwen3 configuration: ") as e:
        load_pretrained(tmp_path)
    assert str(e.value).endswith(message) and "\n" not in str(e.value)


def test_a_directory_with_both_weight_layouts_is_refused(tmp_path):
    """transformers reads model.safetensors where an index sits beside it: fw names both rather than read the
    other set."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path / "single")
    model = hf_model(tied=False, kv_heads=2, seed=1)
    model.save_pretrained(tmp_path / "both", max_shard_size="4KB")
    (tmp_path / "both" / "model.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    with pytest.raises(FwError, match=r"holds both model.safetensors and model.safetensors.index.json"):
        load_pretrained(tmp_path / "both")


@pytest.mark.parametrize("weight_map", [["a.safetensors"], {"lm_head.weight": "../other/model.safetensors"}])
def test_a_malformed_index_is_refused_in_one_line(tmp_path, weight_map):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path, max_shard_size="4KB")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FwError, match=r"model.safetensors.index.json: weight_map must map tensor names to shard "
                                      r"files of this directory$"):
        load_pretrained(tmp_path)
