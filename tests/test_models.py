"""Qwen3 policy: presets, build_policy, packed rows, hidden states, the op seam, config validation and
strict checkpoint loading."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import ops_cuda
from framework.errors import FwError
from framework.models import PRESETS, Qwen3ForCausalLM, build_policy, load_pretrained, save_pretrained
from framework.models.qwen3_config import Qwen3Config
from framework.tokenizer import Tokenizer

TINY = {"vocab_size": 110, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}


def tiny_model(seed: int = 0, **kw) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf({**TINY, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model.eval()


def policy_cfg(**kw) -> dict:
    return {"path": None, "preset": None, "dtype": None, "gradient_checkpointing": False, "keep_logits": None,
            "lora": None, "compile": False, **kw}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- presets


def test_qwen3_06b_preset_has_the_published_size():
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config.from_hf(PRESETS["qwen3-0.6b"]))
    assert n_params(model) == 596_049_920 and model.model.embed_tokens.weight.numel() == 155_582_464
    assert model.lm_head is None and model.config.q_size == 2048 != model.config.hidden_size
    cache = model.new_kv_cache(1, 1, dtype=torch.bfloat16)   # meta: shapes only
    assert (cache.k.numel() + cache.v.numel()) * 2 == 114_688   # bytes of KV cache per token


@pytest.mark.parametrize("name,non_embedding_b,total_b,tied", [
    ("qwen3-1.7b", 1.4, 1.7, True), ("qwen3-4b", 3.6, 4.0, True), ("qwen3-8b", 6.95, 8.2, False)])
def test_larger_presets_match_the_model_cards(name, non_embedding_b, total_b, tied):
    # Qwen3 model cards: "Number of Parameters": 1.7B, 4.0B, 8.2B; "(Non-Embedding)": 1.4B, 3.6B, 6.95B
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config.from_hf(PRESETS[name]))
    emb = model.model.embed_tokens.weight.numel() * (1 if tied else 2)
    digits = len(str(non_embedding_b).split(".")[1])
    assert round((n_params(model) - emb) / 1e9, digits) == non_embedding_b
    assert round(n_params(model) / 1e9, 1) == total_b and (model.lm_head is None) is tied


def test_build_policy_from_preset_uses_the_tokenizer_vocabulary():
    tok = Tokenizer.builtin()
    torch.manual_seed(0)
    model = build_policy(policy_cfg(preset="tiny"), tok)
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim) == (tok.vocab_size, 64, 2, 4, 2, 64)
    assert c.eos_token_id == tok.eos_id and model.lm_head_weight.dtype == torch.float32
    assert not model.gradient_checkpointing
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert abs(w.std().item() - 0.02) < 0.003 and torch.equal(model.model.norm.weight, torch.ones(64))
    small = build_policy(policy_cfg(preset="small", dtype="bfloat16", gradient_checkpointing=True), tok)
    assert small.lm_head_weight.dtype == torch.bfloat16 and small.gradient_checkpointing
    assert small.config.hidden_size == 256
    # keep_logits: null follows gradient_checkpointing; true / false override it
    assert model.saves_logits and not small.saves_logits
    for ckpt, keep in ((False, False), (True, True)):
        m = build_policy(policy_cfg(preset="tiny", gradient_checkpointing=ckpt, keep_logits=keep), tok)
        assert m.saves_logits is keep and m.gradient_checkpointing is ckpt


def test_build_policy_from_path_and_bad_settings(tmp_path):
    tok = Tokenizer.builtin()
    model = tiny_model()
    save_pretrained(model, tmp_path)
    loaded = build_policy(policy_cfg(path=str(tmp_path), dtype="bfloat16"), tok)
    assert loaded.lm_head_weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head_weight, model.lm_head_weight.to(torch.bfloat16))
    with pytest.raises(FwError, match="exactly one of path"):
        build_policy(policy_cfg(path=str(tmp_path), preset="tiny"), tok)
    with pytest.raises(FwError, match="exactly one of path"):
        build_policy(policy_cfg(), tok)
    with pytest.raises(FwError, match="unknown model preset 'huge'"):
        build_policy(policy_cfg(preset="huge"), tok)
    with pytest.raises(FwError, match="unknown dtype 'fp8'"):
        build_policy(policy_cfg(preset="tiny", dtype="fp8"), tok)
    save_pretrained(tiny_model(vocab_size=100), tmp_path)
    with pytest.raises(FwError, match="the tokenizer has 103 tokens but the model's vocab_size is 100"):
        build_policy(policy_cfg(path=str(tmp_path)), tok)


def test_building_on_the_meta_device_draws_nothing_and_leaves_dynamo_unimported(tmp_path):
    """A preset's init and a checkpoint's load build the model on the meta device first; a normal draw there imports
    torch._dynamo (about a second of `fw generate`), and its values would be thrown away."""
    save_pretrained(tiny_model(), tmp_path)
    script = f"""
import sys, torch
before = "torch._dynamo" in sys.modules
from framework.models import build_policy, load_pretrained
from framework.tokenizer import Tokenizer
cfg = dict(path=None, preset="tiny", dtype=None, gradient_checkpointing=False, keep_logits=None,
           lora=None, compile=False)
model = build_policy(cfg, Tokenizer.builtin(), seed=0)
loaded = load_pretrained({str(tmp_path)!r})
assert not model.model.embed_tokens.weight.is_meta and not loaded.lm_head_weight.is_meta
print(before, "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "True":
        pytest.skip("this torch imports torch._dynamo with torch")
    assert out == ["False", "False"]


@pytest.mark.slow
def test_compile_gives_the_same_logits():
    tok = Tokenizer.builtin()
    model = build_policy(policy_cfg(preset="tiny"), tok).eval()
    ids = torch.randint(0, tok.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model(ids)
    compiled = build_policy(policy_cfg(preset="tiny", compile=True), tok)
    compiled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(compiled.eval()(ids), expected, atol=1e-5)
    assert isinstance(compiled, Qwen3ForCausalLM) and set(compiled.state_dict()) == set(model.state_dict())


@pytest.mark.gpu
def test_compiled_training_step_on_gpu():
    tok = Tokenizer.builtin()
    torch.manual_seed(0)
    eager = build_policy(policy_cfg(preset="small"), tok).cuda()
    compiled = build_policy(policy_cfg(preset="small", compile=True, gradient_checkpointing=True), tok).cuda()
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, tok.vocab_size, (4, 64), device="cuda")
    positions = torch.cat([torch.arange(40), torch.arange(24)]).expand(4, 64).cuda()   # packed rows
    losses = []
    for model in (eager.train(), compiled.train()):
        logits = model(ids, position_ids=positions)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], atol=1e-4)
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------- forward


def test_packed_rows_keep_attention_inside_each_sequence():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(0, 110, (n,), generator=g) for n in (5, 7, 3))
    packed = torch.cat([a, b, c])[None]
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(3)])[None]
    with torch.no_grad():
        out = model(packed, position_ids=positions)[0]
        for seq, start in ((a, 0), (b, 5), (c, 12)):
            alone = model(seq[None])[0]
            assert (out[start:start + len(seq)] - alone).abs().max().item() <= 1e-5
        # without position_ids the row is one sequence: the second segment then sees the first
        assert (model(packed)[0, 5:12] - out[5:12]).abs().max().item() > 1e-2


def test_packed_rows_equal_per_sequence_runs_in_float64():
    """Two packed rows (varlen attention) against each sequence run alone (plain causal attention): the
    logits, and the gradients of every parameter of a loss on every token."""
    model = tiny_model(3).double().train()
    g = torch.Generator().manual_seed(4)
    lengths = [(6, 1, 9), (12, 4)]   # row lengths 16 and 16
    seqs = [[torch.randint(0, 110, (n,), generator=g) for n in row] for row in lengths]
    ids = torch.stack([torch.cat(row) for row in seqs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    weights = torch.randn(2, 16, 110, generator=g, dtype=torch.float64)
    logits = model(ids, position_ids=positions)
    packed_grads = torch.autograd.grad((logits * weights).sum(), list(model.parameters()))
    alone_loss = 0
    for b, row in enumerate(seqs):
        start = 0
        for seq in row:
            alone = model(seq[None])[0]
            assert (logits[b, start:start + len(seq)] - alone).abs().max().item() <= 1e-12
            alone_loss = alone_loss + (alone * weights[b, start:start + len(seq)]).sum()
            start += len(seq)
    alone_grads = torch.autograd.grad(alone_loss, list(model.parameters()))
    for p, q in zip(packed_grads, alone_grads, strict=True):
        assert (p - q).abs().max().item() <= 1e-10 * max(1.0, q.abs().max().item())


def test_right_padding_does_not_change_real_tokens():
    model = tiny_model()
    ids = torch.randint(1, 50, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    with torch.no_grad():
        assert (model(padded)[0, :6] - model(ids)[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_return_hidden_and_lm_head_weight(tied):
    model = tiny_model(tie_word_embeddings=tied)
    ids = torch.randint(0, 110, (2, 7))
    with torch.no_grad():
        h = model(ids, return_hidden=True)
        logits = model(ids)
    assert h.shape == (2, 7, 32)
    assert torch.allclose(F.linear(h, model.lm_head_weight), logits, atol=1e-6)
    assert (model.lm_head_weight is model.model.embed_tokens.weight) is tied
    lp, _ = ops_cuda.linear_logprob(h[:, :-1].reshape(-1, 32), model.lm_head_weight, ids[:, 1:].reshape(-1))
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).reshape(-1)
    assert torch.allclose(lp, expected, atol=1e-5)


def test_every_norm_rope_activation_and_attention_goes_through_ops_cuda(monkeypatch):
    calls = {name: 0 for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "swiglu", "attention",
                                  "decode_attention")}
    for name in calls:
        real = getattr(ops_cuda, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)
        monkeypatch.setattr(ops_cuda, name, counted)
    model = tiny_model()
    with torch.no_grad():
        model(torch.randint(0, 110, (1, 4)))
    layers = model.config.num_hidden_layers
    # the first layer's input norm and the final norm; each residual add but the last runs with the norm after it;
    # QK-norm with RoPE is one op a layer
    assert calls == {"rms_norm": 2, "add_rms_norm": 2 * layers - 1, "qk_norm_rope": layers, "swiglu": layers,
                     "attention": layers, "decode_attention": 0}
    cache = model.new_kv_cache(1, 8)
    model.prefill(torch.randint(0, 110, (1, 4)), torch.tensor([4]), cache)
    model.decode(torch.tensor([3]), cache)
    assert calls["decode_attention"] == layers and calls["attention"] == 2 * layers


def test_gradient_checkpointing_recomputes_layers_with_equal_gradients():
    ids = torch.randint(0, 110, (2, 8))
    grads = []
    for ckpt in (False, True):
        model = tiny_model().train()
        model.gradient_checkpointing = ckpt
        runs = []
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        F.cross_entropy(model(ids)[:, :-1].reshape(-1, 110), ids[:, 1:].reshape(-1)).backward()
        assert len(runs) == (2 if ckpt else 1)   # recomputed once in the backward pass
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------- config


def test_hf_state_dict_names_and_shapes_are_transformers_own():
    for tied in (True, False):
        ours = tiny_model(tie_word_embeddings=tied)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, "tie_word_embeddings": tied}))
        expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()
                    if not (tied and k == "lm_head.weight")}
        assert {k: tuple(v.shape) for k, v in ours.hf_state_dict().items()} == expected


def test_config_round_trip_and_transformers_format():
    config = Qwen3Config.from_hf({**TINY, "rope_theta": 123.0, "rms_norm_eps": 1e-5, "bos_token_id": 3})
    assert Qwen3Config.from_hf(config.to_hf("bfloat16")) == config
    hf5 = transformers.Qwen3Config(**{**TINY, "rope_theta": 777.0}).to_dict()   # rope_parameters layout
    assert "rope_parameters" in hf5 and Qwen3Config.from_hf(hf5).rope_theta == 777.0
    no_head_dim = {k: v for k, v in TINY.items() if k != "head_dim"}
    # what transformers builds from the same config.json (its Qwen3Config default, 128 — not hidden // heads)
    assert Qwen3Config.from_hf(no_head_dim).head_dim == transformers.Qwen3Config(**no_head_dim).head_dim


@pytest.mark.parametrize("change,match", [
    ({"attention_bias": True}, "attention_bias: true"),
    ({"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 0}, "use_sliding_window: true"),
    ({"num_experts": 8}, "num_experts: 8 .mixture-of-experts"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling: .*only plain RoPE"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
    ({"model_type": "qwen3_moe"}, "model_type is 'qwen3_moe'"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"hidden_size": None}, r"missing required keys \['hidden_size'\]"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a finite number, got '1e-5'"),
    ({"rope_theta": "big"}, "rope_theta must be a number, got 'big'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
])
def test_unsupported_configs_are_rejected(tmp_path, change, match):
    d = {k: v for k, v in {**TINY, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(FwError, match=match) as e:
        load_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


@pytest.mark.parametrize("key", ["vocab_size", "num_attention_heads"])
def test_a_null_required_key_is_a_missing_key(tmp_path, key):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, key: None}))
    with pytest.raises(FwError, match=rf"missing required keys \['{key}'\]") as e:
        load_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_a_null_num_key_value_heads_is_one_per_attention_head_as_in_transformers(tmp_path):
    """A config.json with "num_key_value_heads": null: the model transformers builds from the same directory (its
    Qwen3Config reads null as num_attention_heads), the same logits."""
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, "num_key_value_heads": None})).eval()
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": None}))
    ref = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_pretrained(tmp_path).eval()
    assert ours.config.num_key_value_heads == ref.config.num_key_value_heads == TINY["num_attention_heads"]
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- strict loading


def _edit_checkpoint(path, edit):
    sd = load_file(str(path / "model.safetensors"))
    edit(sd)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_strict_loading_names_the_tensor(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    _edit_checkpoint(tmp_path, lambda sd: sd.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(FwError, match=r"missing tensors \['model.layers.1.self_attn.k_norm.weight'\]"):
        load_pretrained(tmp_path)
    save_pretrained(tiny_model(), tmp_path)
    _edit_checkpoint(tmp_path, lambda sd: sd.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(FwError, match="unexpected tensor model.layers.0.self_attn.q_proj.bias"):
        load_pretrained(tmp_path)
    save_pretrained(tiny_model(), tmp_path)
    _edit_checkpoint(tmp_path, lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(47, 32)}))
    with pytest.raises(FwError, match=r"tensor model.layers.0.mlp.up_proj.weight has shape \(47, 32\), "
                                      r"expected \(48, 32\)"):
        load_pretrained(tmp_path)
    model = tiny_model()
    sd = model.hf_state_dict()
    with pytest.raises(FwError, match=r"missing tensors \['lm_head.weight'\]"):
        model.load_hf_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"})


def test_tied_checkpoint_may_carry_a_copy_of_the_embedding(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    save_pretrained(model, tmp_path)
    emb = model.model.embed_tokens.weight.detach()
    _edit_checkpoint(tmp_path, lambda sd: sd.update({"lm_head.weight": emb.clone()}))
    assert torch.equal(load_pretrained(tmp_path).lm_head_weight, emb)
    _edit_checkpoint(tmp_path, lambda sd: sd.update({"lm_head.weight": emb + 1}))
    with pytest.raises(FwError, match="lm_head.weight is present and differs"):
        load_pretrained(tmp_path)


def test_checkpoint_directory_errors(tmp_path):
    with pytest.raises(FwError, match="no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FwError, match=r"no model.safetensors .*only safetensors checkpoints are supported"):
        load_pretrained(tmp_path)
    save_pretrained(tiny_model(), tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = min(index["weight_map"].values())
    (tmp_path / first).unlink()
    with pytest.raises(FwError, match=f"names shard files that do not exist.*{first}"):
        load_pretrained(tmp_path)
    with pytest.raises(FwError, match="max_shard_size 'lots'"):
        save_pretrained(tiny_model(), tmp_path, max_shard_size="lots")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_shard_is_named(tmp_path, damage):
    save_pretrained(tiny_model(), tmp_path, max_shard_size="20KB")
    shard = tmp_path / min(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(FwError, match=f"^{shard}: not a readable safetensors file"):
        load_pretrained(tmp_path)


def test_saving_again_replaces_old_shards(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path, max_shard_size="10KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert torch.equal(load_pretrained(tmp_path).lm_head_weight, model.lm_head_weight)
