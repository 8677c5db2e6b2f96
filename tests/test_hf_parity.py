"""Logit parity with transformers' Qwen3ForCausalLM on random weights, both checkpoint directions."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from framework.models import Qwen3ForCausalLM, load_pretrained, save_pretrained
from framework.models.qwen3_config import Qwen3Config

VOCAB = 101


def hf_config(tied: bool, kv_heads: int, **kw) -> transformers.Qwen3Config:
    # head_dim 24 with hidden 48 and 4 heads: q width 96 != hidden, as in the real models
    args = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 72, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": kv_heads, "head_dim": 24, "rope_theta": 5000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": tied, "max_position_embeddings": 512}
    return transformers.Qwen3Config(**{**args, **kw})


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that logits spread over several units (HF's init gives near-zero logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.25 * noise)
    return model


def hf_model(tied: bool, kv_heads: int, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return randomize(transformers.Qwen3ForCausalLM(hf_config(tied, kv_heads, **kw)), seed).eval()


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def shard_files(path):
    return sorted(p.name for p in path.glob("*.safetensors"))


@pytest.mark.parametrize("tied,kv_heads,shard", [
    (True, 4, None),       # GQA ratio 1, single file
    (False, 2, "4KB"),     # GQA ratio 2, sharded
    (True, 1, "4KB"),      # GQA ratio 4 (MQA), sharded
    (False, 4, None),
])
def test_transformers_checkpoint_loads_with_same_logits(tmp_path, tied, kv_heads, shard):
    ref = hf_model(tied, kv_heads)
    ref.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    ours = load_pretrained(tmp_path)
    assert ours.config.tie_word_embeddings is tied and ours.config.rope_theta == 5000.0
    assert (ours.lm_head is None) is tied
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(ref, ids)
    with torch.no_grad():
        got = ours(ids)
    assert got.shape == (3, 19, VOCAB) and got.dtype == torch.float32
    assert expected.std() > 1.0   # logits far from zero: the comparison means something
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_packed_rows_match_transformers_on_each_sequence(tmp_path, kv_heads):
    """A packed row through fw's varlen attention against transformers' Qwen3 run on each sequence alone,
    in float64."""
    ref = hf_model(False, kv_heads).double()
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).double()
    g = torch.Generator().manual_seed(2)
    lengths = (7, 1, 12, 4)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = ours(torch.cat(seqs)[None], position_ids=positions)[0]
    start = 0
    for seq in seqs:
        expected = hf_logits(ref, seq[None])[0]
        assert expected.std() > 1.0 or len(seq) == 1
        # transformers' RMSNorm and rotary run in float32 even for float64 weights: its rounding, not ours
        assert (got[start:start + len(seq)] - expected).abs().max().item() <= 1e-5
        start += len(seq)


@pytest.mark.parametrize("tied,kv_heads,shard", [(True, 2, "5GB"), (False, 4, "3KB"), (False, 1, None)])
def test_our_checkpoint_loads_in_transformers_with_same_logits(tmp_path, tied, kv_heads, shard):
    config = Qwen3Config.from_hf(hf_config(tied, kv_heads).to_dict())
    ours = randomize(Qwen3ForCausalLM(config), seed=3).eval()
    save_pretrained(ours, tmp_path, **({"max_shard_size": shard} if shard else {}))
    files = shard_files(tmp_path)
    sharded = shard == "3KB"
    assert (files == ["model.safetensors"]) is not sharded
    if sharded:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    names = set()
    for f in files:
        with safe_open(str(tmp_path / f), "pt") as st:
            names |= set(st.keys())
    assert ("lm_head.weight" in names) is not tied
    assert "model.layers.1.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(ref).__name__ == "Qwen3ForCausalLM" and ref.config.rope_parameters["rope_theta"] == 5000.0
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ours(ids)
    expected = hf_logits(ref.eval(), ids)
    assert expected.std() > 1.0
    assert (got - expected).abs().max().item() <= 1e-4


def test_round_trip_is_bit_exact_in_bf16(tmp_path):
    ours = randomize(Qwen3ForCausalLM(Qwen3Config.from_hf(hf_config(False, 2).to_dict())), seed=4)
    ours = ours.to(torch.bfloat16)
    save_pretrained(ours, tmp_path, max_shard_size="2KB")
    again = load_pretrained(tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for (n, a), (m, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert n == m and a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    # loading converts dtype on the way in
    assert load_pretrained(tmp_path).lm_head_weight.dtype == torch.float32


def _gpu_reference():
    ref32 = hf_model(False, 2, seed=5, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                     num_attention_heads=8, head_dim=64)
    for p in ref32.parameters():   # smaller weights for a deeper model: logits of a few units
        p.data.mul_(0.5 if p.dim() > 1 else 1.0)
    return ref32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_on_gpu(tmp_path, dtype):
    ref32 = _gpu_reference()
    ref32.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (4, 200), generator=torch.Generator().manual_seed(6)).cuda()
    expected = hf_logits(ref32.cuda(), ids).float()
    ours = load_pretrained(tmp_path, dtype=dtype, device="cuda")
    with torch.no_grad():
        got = ours(ids).float()
    if dtype == torch.float32:
        assert (got - expected).abs().max().item() <= 1e-4
    else:
        # transformers in bf16 is the yardstick for how far bf16 rounding moves the logits
        hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).cuda()
        hf_err = ((hf_logits(hf16, ids).float() - expected).norm() / expected.norm()).item()
        err = ((got - expected).norm() / expected.norm()).item()
        assert err <= max(2 * hf_err, 1e-2), (err, hf_err)
