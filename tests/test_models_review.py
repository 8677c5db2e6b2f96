"""Review of the model code against transformers: checkpoints transformers writes with damaged tensors, and what fw
loads from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_parity import hf_model

from framework.errors import FwError
from framework.models import load_pretrained


def _retype(file: Path, name: str, dtype: torch.dtype) -> None:
    """Rewrite safetensors `file` with tensor `name` stored in `dtype`, same shape."""
    sd = load_file(str(file))
    value = sd[name]
    sd[name] = (value * 4).round().to(dtype) if dtype != torch.bool else value > 0
    save_file(sd, str(file), metadata={"format": "pt"})


def _holder(path: Path, name: str) -> Path:
    index = path / "model.safetensors.index.json"
    return path / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("shard", [None, "8KB"])
def test_a_tensor_stored_in_a_non_float_dtype_is_named_with_its_file(tmp_path, dtype, shard):
    """An integer, bool, complex or float8 tensor is no plain weight (float8 without its scales is a quantised one,
    which fw refuses): copying it into the float model would load wrong numbers without a word."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    name = "model.layers.1.self_attn.k_proj.weight"
    file = _holder(tmp_path, name)
    _retype(file, name, dtype)
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == (f"{file}: tensor {name} has dtype {str(dtype).removeprefix('torch.')}, expected "
                            "float32, bfloat16, float16 or float64")


def test_a_tied_checkpoints_lm_head_copy_in_an_integer_dtype_is_named(tmp_path):
    """A tied checkpoint may carry lm_head.weight as a copy of the embedding; one stored as integers is refused
    as any other tensor, even where its values equal the embedding's."""
    model = hf_model(tied=True, kv_heads=2)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_((model.model.embed_tokens.weight * 4).round())
    model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].to(torch.int32)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'model.safetensors'}: tensor lm_head.weight has dtype int32, expected "
                            "float32, bfloat16, float16 or float64")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_dtypes_still_load_as_transformers_reads_them(tmp_path, dtype):
    """A tensor in another float dtype than its neighbours is a weight: loaded, converted to the model's dtype."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd[name] = sd[name].to(dtype)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_pretrained(tmp_path)
    assert torch.equal(ours.model.layers[0].mlp.down_proj.weight, sd[name].float())
