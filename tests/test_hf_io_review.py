"""Hugging Face checkpoint I/O against transformers (and PEFT) as the reference: directories transformers writes in
other dtypes, RoPE and window settings, malformed config.json files, indexes, and `fw export` of a LoRA run
(merged and as adapters) read back by transformers with fw's logits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from test_export import save_lora_checkpoint
from test_hf_parity import VOCAB, hf_logits, hf_model

from framework.errors import FwError
from framework.export import export_checkpoint
from framework.models import load_pretrained
from framework.models.qwen3_config import Qwen3Config
from framework.tokenizer import Tokenizer

# Both sides compute in float32 from the same weights; they differ only in summation order over at most 96 terms
# (and, merged, in one rounding of W + s * B @ A), some 1e-6 on logits of spread > 1. A wrong RoPE base, window
# or adapter scale moves logits by 1e-2 and more.
TOL = 1e-4


def _ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(1))


def _edit_config(path: Path, drop: tuple[str, ...] = (), **changes) -> None:
    """config.json with `changes` and without `drop`; without the layer_types transformers wrote, so that it derives
    them again."""
    config = json.loads((path / "config.json").read_text())
    for key in ("layer_types", *drop):
        config.pop(key, None)
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _same_logits_as_transformers(path: Path) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_logits(ref, _ids())
    with torch.no_grad():
        got = load_pretrained(path)(_ids())
    assert expected.std() > 1.0
    assert (got - expected).abs().max().item() <= TOL


# ---------------------------------------------------------------- what transformers writes

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_sharded_checkpoint_loads_in_float32_with_transformers_logits(tmp_path, dtype):
    """Weights stored in bf16 / fp16 over several shards: fw's default float32 model holds exactly the stored
    values, as transformers' float32 load does."""
    hf_model(tied=False, kv_heads=2).to(dtype).save_pretrained(tmp_path, max_shard_size="8KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_pretrained(tmp_path)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    with safe_open(str(tmp_path / json.loads((tmp_path / "model.safetensors.index.json").read_text())
                        ["weight_map"]["lm_head.weight"]), framework="pt") as f:
        stored = f.get_tensor("lm_head.weight")
    assert stored.dtype == dtype and torch.equal(ours.lm_head.weight, stored.float())
    _same_logits_as_transformers(tmp_path)


@pytest.mark.parametrize("rope_scaling", [{"type": "default"}, {"rope_type": "default", "rope_theta": 777.0}],
                         ids=["type-default", "rope_type-default-with-theta"])
def test_a_rope_scaling_of_plain_rope_loads_with_transformers_logits(tmp_path, rope_scaling):
    """A config.json of the older layout whose rope_scaling names plain RoPE (transformers reads a rope_theta
    inside it over the top-level one): the model transformers builds, not a refusal."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    _edit_config(tmp_path, drop=("rope_parameters",), rope_theta=5000.0, rope_scaling=rope_scaling)
    assert load_pretrained(tmp_path).config.rope_theta == rope_scaling.get("rope_theta", 5000.0)
    _same_logits_as_transformers(tmp_path)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
                                  {"rope_type": "linear", "factor": 2.0}], ids=["yarn", "linear"])
def test_scaled_rope_that_transformers_writes_is_refused_in_one_line(tmp_path, rope):
    hf_model(tied=False, kv_heads=2, rope_parameters={**rope, "rope_theta": 5000.0}).save_pretrained(tmp_path)
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: unsupported Qwen3 configuration: rope_parameters: ")
    assert f"'rope_type': '{rope['rope_type']}'" in str(e.value) and "\n" not in str(e.value)


def test_a_window_config_json_leaves_to_transformers_default_is_refused(tmp_path):
    """use_sliding_window without a sliding_window key: transformers windows the layers from max_window_layers on
    with its default window, which fw does not implement."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    _edit_config(tmp_path, drop=("sliding_window",), use_sliding_window=True, max_window_layers=1)
    assert transformers.AutoConfig.from_pretrained(tmp_path).layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(FwError, match=r"use_sliding_window: true \(sliding-window attention is not implemented\)$"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("layers", [2, 28, 30])
def test_a_max_window_layers_config_json_leaves_out_is_transformers_default(tmp_path, layers):
    """use_sliding_window with a window but no max_window_layers: transformers windows the layers from its default
    (28) on, so a model of 28 layers or fewer has none windowed and loads; one of more layers is refused."""
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      use_sliding_window=True, sliding_window=8)
    config.save_pretrained(tmp_path)
    _edit_config(tmp_path, drop=("max_window_layers",))
    windowed = "sliding_attention" in transformers.AutoConfig.from_pretrained(tmp_path).layer_types
    assert windowed == (layers > 28)
    if windowed:
        with pytest.raises(FwError, match=r"use_sliding_window: true \(sliding-window attention"):
            Qwen3Config.from_hf(json.loads((tmp_path / "config.json").read_text()))
    else:
        assert Qwen3Config.from_hf(json.loads((tmp_path / "config.json").read_text())).num_hidden_layers == layers


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_another_model_type_is_refused_in_one_line(tmp_path, model_type):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    _edit_config(tmp_path, model_type=model_type)
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'config.json'}: model_type is {model_type!r}; only dense Qwen3 ('qwen3') "
                            "is supported")


# ---------------------------------------------------------------- malformed files

@pytest.mark.parametrize("text,got", [(b"[]", "list"), (b"null", "NoneType"), (b'"qwen3"', "str")])
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, text, got):
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: expected a JSON object, got {got}"


def test_a_config_json_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(FwError, match=r"config.json: invalid JSON: 'utf-8' codec can't decode byte 0xff") as e:
        load_pretrained(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_settings_that_are_not_an_object_are_refused_naming_the_key(tmp_path, key):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    _edit_config(tmp_path, **{key: [5000.0]})
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'config.json'}: unsupported Qwen3 configuration: {key}: [5000.0] "
                            "(only plain RoPE is implemented)")


def test_an_index_entry_whose_shard_lacks_the_tensor_is_a_missing_tensor(tmp_path):
    """The index sends the tensors of one shard to another that does not hold them (the shard that did is no
    longer named): fw names those tensors rather than leave them uninitialised."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path, max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    holder = index["weight_map"]["model.norm.weight"]
    other = next(f for n, f in index["weight_map"].items() if f != holder)
    lost = sorted(n for n, f in index["weight_map"].items() if f == holder)
    index["weight_map"] = {n: (other if f == holder else f) for n, f in index["weight_map"].items()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
    assert str(e.value) == (f"{tmp_path / other}: missing tensors {lost[:8]}{more}, which "
                            "model.safetensors.index.json places in that shard")


# ---------------------------------------------------------------- fw export of a LoRA run

def _lora_checkpoint(tmp_path: Path, dtype: str | None) -> tuple[Path, Path, torch.nn.Module]:
    """(base directory, checkpoint, adapted policy) of a LoRA run on an HF base whose adapters are random (not
    PEFT's B = 0, under which merging changes nothing)."""
    from framework.config import resolve
    from framework.models import build_policy
    from framework.models.lora import peft_targets

    tok = Tokenizer.builtin()
    base = tmp_path / "base"
    hf_model(tied=False, kv_heads=2, vocab_size=tok.vocab_size).save_pretrained(base)
    tok.save_pretrained(base)
    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
    cfg = resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"),
                   "model": {"policy": {"path": str(base), "dtype": dtype, "lora": lora}}})
    policy = build_policy(cfg["model"]["policy"], tok, seed=cfg["seed"]).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t, _, _ in peft_targets(policy).values():
            t.copy_(0.3 * torch.randn(t.shape, generator=g))
    path = save_lora_checkpoint(cfg, policy, tok, base)
    return base, path, policy


def test_a_merged_lora_export_gives_transformers_the_adapted_policys_logits(tmp_path):
    base, ckpt, policy = _lora_checkpoint(tmp_path, None)
    out = Path(export_checkpoint(ckpt, tmp_path / "merged", merge=True))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = _ids(policy.config.vocab_size)
    with torch.no_grad():
        expected, got = policy(ids), hf_logits(hf.eval(), ids)
        plain = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval(),
                          ids)
    assert expected.std() > 1.0 and (expected - plain).abs().max().item() > 0.1   # the adapters matter
    assert (got - expected).abs().max().item() <= TOL
    assert transformers.AutoTokenizer.from_pretrained(str(out)).encode("1+1=<|im_end|>", add_special_tokens=False) \
        == Tokenizer.builtin().encode("1+1=<|im_end|>")


def test_an_adapter_export_gives_peft_the_adapted_policys_logits(tmp_path):
    """Without --merge, PEFT's adapter directory: PEFT applies it to the base with fw's logits."""
    peft = pytest.importorskip("peft")
    base, ckpt, policy = _lora_checkpoint(tmp_path, None)
    out = Path(export_checkpoint(ckpt, tmp_path / "adapters"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    ids = _ids(policy.config.vocab_size)
    with torch.no_grad():
        expected, got = policy(ids), hf(input_ids=ids).logits
    assert (got - expected).abs().max().item() <= TOL


def test_a_merged_export_is_stored_in_the_runs_dtype(tmp_path):
    """model.policy.dtype bfloat16: the merged model is written in bfloat16, config.json saying so, and transformers'
    default load gives a bfloat16 model."""
    _, ckpt, _ = _lora_checkpoint(tmp_path, "bfloat16")
    out = Path(export_checkpoint(ckpt, tmp_path / "merged", merge=True))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16
