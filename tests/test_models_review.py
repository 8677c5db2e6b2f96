"""Review of the model code against transformers: checkpoints transformers writes with damaged tensors, and what fw
loads from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_parity import VOCAB, hf_model

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


# ---------------------------------------------------------------- the recipes' forwards against transformers

def _hf_pair(tmp_path: Path, heads: int, kv_heads: int, tied: bool):
    """A float64 transformers Qwen3 (head_dim 12 with hidden 40: q width != hidden; an odd RoPE base and norm eps)
    and fw's float64 load of the directory it saved."""
    ref = hf_model(tied=tied, kv_heads=kv_heads, hidden_size=40, intermediate_size=56, num_attention_heads=heads,
                   head_dim=12, rope_theta=7919.5, rms_norm_eps=3e-3).double()
    ref.save_pretrained(tmp_path)
    return ref, load_pretrained(tmp_path, torch.float64).eval()


def _rows(g: torch.Generator, prompt_lens: list[int], completion_lens: list[int], groups: list[int] | None):
    """Right-padded prompt + completion rows; rows of one group share their prompt."""
    width = max(p + c for p, c in zip(prompt_lens, completion_lens))
    tokens = torch.zeros(len(prompt_lens), width + 3, dtype=torch.long)   # pad columns past the longest row
    prompts: dict[int, torch.Tensor] = {}
    for b, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        key = groups[b] if groups is not None else -1 - b
        prompt = prompts.setdefault(key, torch.randint(0, VOCAB, (p,), generator=g))
        tokens[b, :p] = prompt
        tokens[b, p:p + c] = torch.randint(0, VOCAB, (c,), generator=g)
    return tokens


@pytest.mark.parametrize("heads,kv_heads,tied", [(8, 8, True), (8, 4, False), (8, 2, True), (8, 1, False)])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_rl_completion_logprobs_are_transformers_on_each_masked_row(tmp_path, heads, kv_heads, tied, layout):
    """recipes.rl's logprobs of right-padded rows, padded, packed or with shared prompts, against transformers'
    log_softmax(logits / T) over the same right-padded batch with its attention mask, GQA ratios 1 to 8."""
    from recipes.rl import completion_logprobs

    ref, ours = _hf_pair(tmp_path, heads, kv_heads, tied)
    g = torch.Generator().manual_seed(5)
    p, c = [6, 6, 3, 9, 9], [5, 2, 7, 0, 4]
    groups = [0, 0, 1, 2, 2]
    tokens = _rows(g, p, c, groups)
    width, temperature = max(c), 0.7
    with torch.no_grad():
        got, _ = completion_logprobs(ours, tokens, torch.tensor(p), torch.tensor(c), width, temperature,
                                     packed=layout == "packed",
                                     groups=torch.tensor(groups) if layout == "shared" else None)
        lens = torch.tensor(p) + torch.tensor(c)
        mask = (torch.arange(tokens.shape[1])[None] < lens[:, None]).long()
        logp = torch.log_softmax(ref(input_ids=tokens, attention_mask=mask).logits / temperature, -1)
    expected = torch.zeros(len(p), width, dtype=torch.float64)
    for b in range(len(p)):
        for j in range(c[b]):
            expected[b, j] = logp[b, p[b] + j - 1, tokens[b, p[b] + j]]
    assert expected.abs().max() > 1.0
    # transformers' norms and RoPE run in float32 even for float64 weights: its rounding, not fw's
    assert (got.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("heads,kv_heads,tied", [(8, 8, False), (8, 1, True)])
def test_prefill_and_decode_give_transformers_last_position_logits(tmp_path, heads, kv_heads, tied):
    """Generation's logits: those of each right-padded prompt's last real token after prefill, then of two
    decode steps, equal transformers' last-position logits of each row run alone."""
    ref, ours = _hf_pair(tmp_path, heads, kv_heads, tied)
    g = torch.Generator().manual_seed(6)
    lengths = torch.tensor([11, 1, 7])
    prompts = torch.randint(0, VOCAB, (3, 11), generator=g)
    steps = torch.randint(0, VOCAB, (2, 3), generator=g)
    with torch.no_grad():
        cache = ours.new_kv_cache(3, 16)
        got = [ours.prefill(prompts, lengths, cache)] + [ours.decode(s, cache) for s in steps]
        for b in range(3):
            seq = prompts[b, :lengths[b]]
            for k, logits in enumerate(got):
                row = torch.cat([seq, steps[:k, b]])[None]
                expected = ref(input_ids=row).logits[0, -1]
                assert expected.std() > 1.0
                assert (logits[b] - expected).abs().max().item() <= 1e-5
