"""KV cache: prefill + decode over ragged right-padded prompts equals the full forward; greedy decoding
matches transformers' generate."""

import pytest
import torch
import transformers

from framework.errors import FwError
from framework.models import KVCache, Qwen3ForCausalLM, load_pretrained
from framework.models.qwen3_config import Qwen3Config

VOCAB = 89
PAD = 0


def make_model(kv_heads: int, seed: int = 0, **kw) -> Qwen3ForCausalLM:
    d = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": kv_heads, "head_dim": 32, "rope_theta": 10000.0,
         "tie_word_embeddings": False, **kw}
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(d))
    with torch.no_grad():   # spread-out logits so that equality is a real check
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return model.eval()


def ragged_batch(lengths: list[int], seed: int = 1) -> tuple[list[list[int]], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    padded = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = torch.tensor(p)
    return prompts, padded


def check_against_full_forward(model, lengths, steps, device="cpu", atol=1e-5, rel=None):
    prompts, padded = ragged_batch(lengths)
    cache = model.new_kv_cache(len(lengths), max(lengths) + steps, device=device)
    assert isinstance(cache, KVCache)
    c = model.config
    assert cache.k.shape == (c.num_hidden_layers, len(lengths), c.num_key_value_heads, max(lengths) + steps,
                             c.head_dim) and cache.v.shape == cache.k.shape
    logits = model.prefill(padded.to(device), torch.tensor(lengths), cache)
    assert cache.lengths.tolist() == lengths
    new = torch.randint(1, VOCAB, (steps, len(lengths)), generator=torch.Generator().manual_seed(2))
    seqs = [list(p) for p in prompts]
    for step in range(steps + 1):
        for b, seq in enumerate(seqs):   # reference: the whole unpadded sequence, one row at a time
            with torch.no_grad():
                full = model(torch.tensor([seq], device=device))[0, -1]
            got = logits[b]
            if rel is None:
                assert (got - full).abs().max().item() <= atol, (step, b)
            else:
                assert ((got.float() - full.float()).norm() / full.float().norm()).item() <= rel, (step, b)
        if step == steps:
            break
        logits = model.decode(new[step].to(device), cache)
        for b, seq in enumerate(seqs):
            seq.append(int(new[step, b]))
        assert cache.lengths.tolist() == [n + step + 1 for n in lengths]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prefill_and_decode_equal_full_forward_on_ragged_prompts(kv_heads):
    check_against_full_forward(make_model(kv_heads), lengths=[5, 1, 9, 3], steps=6)


def test_cache_defaults_to_model_dtype_and_checks_its_inputs():
    model = make_model(2)
    assert model.new_kv_cache(2, 8).k.dtype == torch.float32
    assert model.to(torch.bfloat16).new_kv_cache(2, 8).v.dtype == torch.bfloat16
    model = model.float()
    _, padded = ragged_batch([3, 2])
    cache = model.new_kv_cache(2, 8)
    with pytest.raises(FwError, match="lengths must be in 1..3"):
        model.prefill(padded, torch.tensor([3, 0]), cache)
    with pytest.raises(FwError, match="do not fit the cache"):
        model.prefill(padded, torch.tensor([3, 2]), model.new_kv_cache(2, 2))
    model.prefill(padded, torch.tensor([3, 2]), cache)
    with pytest.raises(FwError, match="needs an empty cache"):
        model.prefill(padded, torch.tensor([3, 2]), cache)
    with pytest.raises(FwError, match="tokens must be"):
        model.decode(torch.tensor([1, 2, 3]), cache)


def test_greedy_decoding_matches_transformers_generate(tmp_path):
    hf_cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(7)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    lengths, steps = [6, 2, 4], 10
    prompts, padded = ragged_batch(lengths, seed=3)
    cache = ours.new_kv_cache(len(lengths), max(lengths) + steps)
    logits = ours.prefill(padded, torch.tensor(lengths), cache)
    tokens = []
    for _ in range(steps):
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        logits = ours.decode(nxt, cache)
    ours_out = torch.stack(tokens, 1)
    for b, p in enumerate(prompts):
        out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=PAD, min_new_tokens=steps)
        assert out[0, len(p):].tolist() == ours_out[b].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_on_gpu(dtype):
    model = make_model(2, head_dim=128).to(device="cuda", dtype=dtype)   # Qwen3's head_dim
    if dtype == torch.float32:
        check_against_full_forward(model, lengths=[37, 1, 90, 64], steps=12, device="cuda", atol=1e-4)
    else:
        check_against_full_forward(model, lengths=[37, 1, 90, 64], steps=12, device="cuda", rel=2e-2)
