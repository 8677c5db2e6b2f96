"""LoRA (`model.policy.lora`): adapters on the fused projections against a float64 merge by hand, the
reference with adapters off against the base model, SFT / GRPO / PPO through `fit` (only adapters
change), PEFT's PeftModel loading an fw checkpoint with the same logits, exact resume, and
`fw export` with and without --merge against transformers."""

import json
import os
from pathlib import Path

import lightning.pytorch
import pytest
import torch
import transformers
from safetensors.torch import load_file

from framework.cli import main
from framework.config import load_config, resolve
from framework.errors import FwError
from framework.export import export_checkpoint
from framework.metrics import read_metrics
from framework.models import build_policy, save_pretrained
from framework.models.lora import AdaptersOff, LoraLinear, adapters_detached, adapters_disabled, peft_targets
from framework.models.qwen3 import load_targets
from framework.tasks import render_prompt
from framework.tokenizer import Tokenizer
from framework.trainer import fit

ROOT = Path(__file__).resolve().parent.parent
TIMING = {"tokens_per_s"}
SFT_STEPS = 8
RL_LR, RL_STEPS = 1e-2, 40   # a large step for the adapters of a random-init toy model


def _lora(**kw) -> dict:
    """A resolved model.policy section with LoRA (defaults from the schema, `kw` over them)."""
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny", "lora": kw}}, "data": {"path": "x"}})
    return cfg["model"]["policy"]


def _randomize_adapters(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t, _, _ in peft_targets(model).values():
            t.copy_(0.2 * torch.randn(t.shape, generator=g))


def test_adapters_add_their_rows_only_as_a_float64_merge_by_hand():
    tok = Tokenizer.builtin()
    policy = build_policy(_lora(rank=4, alpha=6, targets=["q_proj", "v_proj", "up_proj", "down_proj"]), tok, seed=1)
    _randomize_adapters(policy, 2)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {
        n for n, _ in policy.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    attn = policy.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, LoraLinear) and not isinstance(policy.model.layers[0].self_attn.q_norm,
                                                                       LoraLinear)
    assert sorted(attn.qkv_proj.rows) == ["q_proj", "v_proj"] and not isinstance(attn.o_proj, LoraLinear)

    # The reference: a plain float64 model with W + (alpha / rank) * B @ A written by hand per HF tensor.
    c = policy.config
    with adapters_detached(policy):
        base = {k: v.double() for k, v in policy.hf_state_dict().items()}
    merged = dict(base)
    for i, layer in enumerate(policy.model.layers):
        qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
        for hf, module, name in [("self_attn.q_proj", qkv, "q_proj"), ("self_attn.v_proj", qkv, "v_proj"),
                                 ("mlp.up_proj", gate_up, "up_proj"), ("mlp.down_proj", down, "down_proj")]:
            key = f"model.layers.{i}.{hf}.weight"
            merged[key] = base[key] + 1.5 * module.lora_B[name].double() @ module.lora_A[name].double()
    plain = build_policy({**_lora(), "lora": None}, tok).double()
    plain.load_hf_state_dict(merged)
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(ids)
        got = policy(ids).double()
        assert (got - want).abs().max() < 1e-4
        plain.load_hf_state_dict(base)
        assert (got - plain(ids)).abs().max() > 0.05   # the adapters do change the output


def peft_twin(policy, tmp_path: Path):
    """transformers' Qwen3 in float64 with the policy's base weights and PEFT's LoRA loaded from its adapters."""
    from peft import PeftModel
    from safetensors.torch import save_file

    from framework.models.lora import adapter_config

    with adapters_detached(policy):
        save_pretrained(policy, tmp_path / "base")
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "adapter_config.json").write_text(json.dumps(adapter_config(policy, None)))
    save_file({k: t.detach().contiguous() for k, (t, _, _) in peft_targets(policy).items()},
              str(tmp_path / "adapters" / "adapter_model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float64)
    return PeftModel.from_pretrained(hf, str(tmp_path / "adapters"), is_trainable=True)


def test_dropout_draws_one_mask_per_adapter_as_peft_does(tmp_path):
    """In training, PEFT's lora_dropout is a module per adapter (q_proj, k_proj, ... each draw their own mask):
    from the same seed, the fused layers' adapters give PEFT's logits on transformers' Qwen3, and in eval neither
    drops."""
    policy = build_policy(_lora(rank=4, alpha=8, dropout=0.3), Tokenizer.builtin(), seed=1).double()
    _randomize_adapters(policy, 2)
    peft_model = peft_twin(policy, tmp_path)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        policy.train(), peft_model.train()
        torch.manual_seed(4)
        got = policy(ids)
        torch.manual_seed(4)
        want = peft_model(input_ids=ids).logits
        assert (got - want).abs().max() < 1e-5
        torch.manual_seed(5)
        assert (policy(ids) - got).abs().max() > 0.05   # the masks do change the output
        policy.eval(), peft_model.eval()
        assert (policy(ids) - peft_model(input_ids=ids).logits).abs().max() < 1e-5


def test_bf16_base_keeps_float32_adapters():
    policy = build_policy({**_lora(rank=2), "dtype": "bfloat16"}, Tokenizer.builtin(), seed=0)
    dtypes = {n.split(".lora_")[0] == n: p.dtype for n, p in policy.named_parameters()}
    assert dtypes == {True: torch.bfloat16, False: torch.float32}
    ids = torch.randint(0, policy.config.vocab_size, (1, 5))
    assert policy(ids).dtype == torch.bfloat16


def test_gradient_checkpointing_gives_the_adapters_the_same_gradients():
    tok = Tokenizer.builtin()
    ids = torch.randint(0, tok.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    grads = []
    for recompute in (False, True):
        policy = build_policy({**_lora(rank=4), "gradient_checkpointing": recompute}, tok, seed=2)
        _randomize_adapters(policy, 3)
        policy(ids).logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in policy.named_parameters() if p.requires_grad})
        assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) and grads[0][n].abs().max() > 0 for n in grads[0])


def test_reference_with_adapters_off_equals_the_base_model(tmp_path):
    from framework.module import FwModule

    cfg = load_config([str(ROOT / "train.yaml")], [f"--run_dir={tmp_path}", "--grpo.kl_coef=0.1",
                                                   "--model.policy.lora={rank: 4}"])
    module = FwModule(cfg)
    assert isinstance(module.reference, AdaptersOff) and module.reference.policy is module.policy
    assert not any(k.startswith("reference.") for k in module.state_dict())   # never saved, never a copy
    _randomize_adapters(module.policy, 4)
    torch.manual_seed(cfg["seed"])
    base = build_policy({**cfg["model"]["policy"], "lora": None}, module.tokenizer, seed=cfg["seed"]).eval()
    ids = torch.randint(0, base.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = module.reference(ids)
        assert torch.equal(ref, base(ids))
        assert torch.equal(module.reference(ids, return_hidden=True), base(ids, return_hidden=True))
        assert not torch.allclose(module.policy(ids), ref, atol=1e-3)   # adapters back on outside the view
    assert module.reference.lm_head_weight is module.policy.lm_head_weight


def _sft_config(run_dir, data, callbacks=()) -> dict:
    return resolve({
        "recipe": "sft", "seed": 5, "run_dir": str(run_dir),
        "model": {"policy": {"preset": "tiny", "lora": {"rank": 8, "dropout": 0.1}}},
        "data": {"path": data, "max_seq_len": 96, "batch_size": 4},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "trainer": {"accelerator": "cpu", "max_steps": SFT_STEPS, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 4, "keep_last": None},
        "eval": {"every_n_steps": SFT_STEPS, "path": str(ROOT / "recipes/data/arithmetic_chat_heldout.jsonl"),
                 "max_prompts": 8},
        "logging": {"csv": False, "tensorboard": False},
        "callbacks": list(callbacks)})


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A LoRA SFT run of 8 steps (checkpoints at 4 and 8): (config, trainer, data path)."""
    lines = (ROOT / "recipes/data/arithmetic_chat.jsonl").read_text().splitlines()[:24]
    data = tmp_path_factory.mktemp("data") / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = _sft_config(tmp_path_factory.mktemp("sft") / "run", str(data))
    return cfg, fit(cfg), str(data)


def _checkpoint(cfg, step=SFT_STEPS) -> Path:
    return Path(cfg["run_dir"]) / "checkpoints" / f"step-{step:06d}"


def _adapted_policy(cfg, ckpt: Path):
    """fw's adapted policy rebuilt the way a user would: base from the config, adapters from the checkpoint."""
    policy = build_policy(cfg["model"]["policy"], Tokenizer.from_pretrained(ckpt / "policy"), seed=cfg["seed"])
    load_targets(peft_targets(policy), load_file(str(ckpt / "policy" / "adapter_model.safetensors")))
    return policy.eval()


def test_sft_trains_only_the_adapters(sft_run):
    cfg, trainer, _ = sft_run
    losses = [r["loss"] for r in read_metrics(Path(cfg["run_dir"]) / "metrics.jsonl")]
    assert len(losses) == SFT_STEPS and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    trained = trainer.lightning_module.policy
    fresh = build_policy(cfg["model"]["policy"], trainer.lightning_module.tokenizer, seed=cfg["seed"])
    fresh_params = dict(fresh.named_parameters())
    for name, p in trained.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and not torch.equal(p, fresh_params[name]), name   # every adapter moved
        else:
            assert not p.requires_grad and torch.equal(p, fresh_params[name]), name   # base bit-identical

    ckpt = _checkpoint(cfg)
    assert sorted(os.listdir(ckpt / "policy")) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    adapter_cfg = json.loads((ckpt / "policy" / "adapter_config.json").read_text())
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"], adapter_cfg["lora_dropout"]) == (8, 32, 0.1)
    assert sorted(adapter_cfg["target_modules"]) == sorted(cfg["model"]["policy"]["lora"]["targets"])
    tensors = load_file(str(ckpt / "policy" / "adapter_model.safetensors"))
    n_layers = trained.config.num_hidden_layers
    assert len(tensors) == 2 * 7 * n_layers
    assert tensors["base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"].shape == (
        trained.config.intermediate_size, 8)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    adam = state["optimizer_states"][0]["state"]
    assert len(adam) == len(tensors)   # optimizer state for the adapters only
    assert sum(v["exp_avg"].numel() for v in adam.values()) == sum(t.numel() for t in tensors.values())


def test_peft_loads_the_checkpoint_onto_transformers_qwen3_with_the_same_logits(sft_run, tmp_path):
    from peft import PeftModel

    cfg, _, _ = sft_run
    ckpt = _checkpoint(cfg)
    policy = _adapted_policy(cfg, ckpt)
    with adapters_detached(policy):   # transformers' Qwen3 from the same base weights
        save_pretrained(policy, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(ckpt / "policy")).eval()
    ids = torch.randint(0, policy.config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = policy(ids)
        with adapters_disabled(policy):
            base = policy(ids)
    assert (got - base).abs().max() > 0.05    # trained adapters matter
    assert (got - want).abs().max() < 1e-4


def test_export_writes_the_adapters_or_with_merge_the_merged_model(sft_run, tmp_path, capsys):
    cfg, _, _ = sft_run
    ckpt = _checkpoint(cfg)
    plain = export_checkpoint(ckpt, tmp_path / "adapters")
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        assert (Path(plain) / name).read_bytes() == (ckpt / "policy" / name).read_bytes()

    assert main(["export", "--checkpoint", str(cfg["run_dir"]), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    assert sorted(os.listdir(tmp_path / "merged")) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"]
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    policy = _adapted_policy(cfg, ckpt)
    ids = torch.randint(0, policy.config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (hf.eval()(input_ids=ids).logits - policy(ids)).abs().max() < 1e-4
    capsys.readouterr()

    # --merge of a full-model checkpoint: one line, exit 2
    full = resolve({**cfg, "model": {"policy": {"preset": "tiny"}}, "run_dir": str(tmp_path / "full"),
                    "trainer": {**cfg["trainer"], "max_steps": 1}})
    fit(full)
    assert main(["export", "--checkpoint", str(tmp_path / "full"), "--out", str(tmp_path / "x"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "holds a full model, not LoRA adapters" in err and "Traceback" not in err


def test_generate_from_a_lora_checkpoint_equals_transformers_on_the_merged_export(sft_run, tmp_path, capsys):
    """`fw generate --checkpoint` of a LoRA run: the base rebuilt from the checkpoint's config with the
    adapters folded in; its greedy text is transformers' greedy decoding of the `--merge` export."""
    cfg, _, _ = sft_run
    ckpt = _checkpoint(cfg)
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    tok = Tokenizer.from_pretrained(ckpt / "policy")
    ids = tok.encode(render_prompt("hello", tok, cfg["data"]["chat_template"], cfg["tokenizer"]["enable_thinking"]))
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_id,
                          pad_token_id=tok.eos_id)[0, len(ids):].tolist()
    expected = tok.decode([t for t in out if t != tok.eos_id])
    policy, seq = _adapted_policy(cfg, ckpt), list(ids)
    with torch.no_grad(), adapters_disabled(policy):   # the base alone decodes differently: the test can fail
        for _ in range(6):
            seq.append(int(policy(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(ids):] != out
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hello", "--greedy", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_fw_eval_of_a_lora_checkpoint_gives_the_logged_eval(sft_run, tmp_path):
    """`fw eval --checkpoint` of a LoRA run (base rebuilt, adapters merged) reports what training logged."""
    cfg, _, _ = sft_run
    logged = [r for r in read_metrics(Path(cfg["run_dir"]) / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in logged] == [SFT_STEPS]
    out = tmp_path / "report.json"
    assert main(["eval", "--checkpoint", str(_checkpoint(cfg)), "--out", str(out)]) == 0
    report = json.loads(out.read_text())["metrics"]
    assert abs(report["eval/loss"] - logged[0]["eval/loss"]) < 1e-5
    assert report["eval/token_accuracy"] == logged[0]["eval/token_accuracy"]


def test_interrupted_lora_run_resumes_exactly(sft_run, tmp_path):
    cfg, _, data = sft_run
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 6}}
    broken = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(_sft_config(broken, data, [crash]))
    fit(_sft_config(broken, data), resume="last")

    def comparable(run_dir):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(Path(run_dir) / "metrics.jsonl")]

    assert comparable(broken) == comparable(cfg["run_dir"])
    a = load_file(str(_checkpoint(cfg) / "policy" / "adapter_model.safetensors"))
    b = load_file(str(broken / "checkpoints" / f"step-{SFT_STEPS:06d}" / "policy" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    other = _sft_config(tmp_path / "other", data)
    other["model"]["policy"]["lora"]["rank"] = 4
    with pytest.raises(FwError, match="model.policy.lora.rank changed from 8 to 4"):
        fit(other, resume=str(_checkpoint(cfg, 4)))
    full = _sft_config(tmp_path / "full", data)
    full["model"]["policy"]["lora"] = None
    with pytest.raises(FwError, match=r"model.policy.lora changed from \{rank: 8, .*\} to null \(the checkpoint"):
        fit(full, resume=str(_checkpoint(cfg, 4)))


@pytest.fixture(scope="module")
def toy_base(tmp_path_factory) -> str:
    """The RL toy's base: the tiny preset with embeddings of std 0.1, as an HF directory with the tokenizer.

    The preset's tied embedding (std 0.02) bounds its logits to about +-1.3 whatever the hidden state
    (whose norm the frozen final RMSNorm fixes), so adapters alone cannot make any token likely; full
    fine-tuning grows the embedding, LoRA keeps it frozen.
    """
    out = tmp_path_factory.mktemp("toy_base")
    tok = Tokenizer.builtin()
    policy = build_policy(load_config([str(ROOT / "train.yaml")])["model"]["policy"], tok, seed=0)
    with torch.no_grad():
        policy.model.embed_tokens.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    save_pretrained(policy, out)
    tok.save_pretrained(out)
    return str(out)


def _rl(tmp_path, path: str, base: str, steps: int, *overrides: str) -> tuple[dict, object, list[dict]]:
    cfg = load_config([str(ROOT / path)], [
        f"--run_dir={tmp_path / 'run'}", f"--trainer.max_steps={steps}", "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false", "--logging.csv=false", "--logging.tensorboard=false",
        f"--checkpoint.every_n_steps={steps}", "--model.policy.preset=null", f"--model.policy.path={base}",
        "--model.policy.lora={rank: 16}", f"--optimizer.lr={RL_LR}", *overrides])
    trainer = fit(cfg)
    return cfg, trainer, read_metrics(tmp_path / "run" / "metrics.jsonl")


def _only_adapters_changed(cfg, module) -> None:
    fresh = dict(build_policy(cfg["model"]["policy"], module.tokenizer, seed=cfg["seed"]).named_parameters())
    for name, p in module.policy.named_parameters():
        assert torch.equal(p.cpu(), fresh[name]) != (".lora_" in name), name


def _rises(metrics: list[dict]) -> tuple[float, float]:
    rewards = [r["reward/mean"] for r in metrics]
    return sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5


def test_grpo_with_lora_uses_the_base_as_kl_reference(tmp_path, toy_base):
    cfg, trainer, metrics = _rl(tmp_path, "train.yaml", toy_base, 2, "--grpo.kl_coef=0.01")
    module = trainer.lightning_module
    assert isinstance(module.reference, AdaptersOff)
    kl = [r["policy/ref_kl"] for r in metrics]
    assert kl[0] == 0.0 and kl[-1] > 0   # the adapters start at zero, then move away from the base
    _only_adapters_changed(cfg, module)


def test_ppo_with_lora_trains_a_full_critic(tmp_path, toy_base):
    # three steps: B starts at 0, so A's first gradient comes the step after B first moves
    cfg, trainer, metrics = _rl(tmp_path, "recipes/ppo.yaml", toy_base, 3)
    module = trainer.lightning_module
    assert isinstance(module.reference, AdaptersOff)
    assert not any(isinstance(m, LoraLinear) for m in module.value.modules())
    assert all(p.requires_grad for p in module.value.parameters())   # the critic trains every weight
    # a step whose returns are all 0 (no sample rewarded: chance is ~1% here) leaves the value loss flat
    assert any(r["value/loss"] > 0 for r in metrics)
    assert all(r["critic_grad_norm"] > 0 for r in metrics if r["value/loss"] > 0)
    _only_adapters_changed(cfg, module)
    ckpt = _checkpoint(cfg, 3)
    assert (ckpt / "value" / "model.safetensors").is_file() and (ckpt / "policy" / "adapter_config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("path", ["train.yaml", "recipes/ppo.yaml"])
def test_rl_with_lora_learns_the_toy_task(tmp_path, toy_base, path):
    _, _, metrics = _rl(tmp_path, path, toy_base, RL_STEPS)
    start, end = _rises(metrics)
    # chance is ~2%; adapters alone learn the toy more slowly than full fine-tuning (GRPO ~0.2, PPO ~0.4 here)
    assert start < 0.08 and end > max(3 * start, start + 0.1), [r["reward/mean"] for r in metrics]


@pytest.mark.gpu
def test_cuda_rollout_with_adapters_graphed_eager_and_merged_agree():
    from framework.models.lora import merged_copy
    from framework.rollout import SamplingParams, generate

    tok = Tokenizer.builtin()
    policy = build_policy({**_lora(), "preset": "small", "dtype": "bfloat16"}, tok, seed=0).cuda()
    _randomize_adapters(policy, 6)
    prompts = [tok.encode(t) for t in ("12+30=", "7=", "123456789+987654321=")]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    graphed = generate(policy, prompts, params, tokenizer=tok)
    eager = generate(policy, prompts, params, tokenizer=tok, cuda_graph=False)
    assert torch.equal(graphed.tokens, eager.tokens)
    assert torch.equal(graphed.logprobs, eager.logprobs)
    merged = merged_copy(policy)
    ids = graphed.tokens
    with torch.no_grad():
        adapted, plain = policy(ids).float(), merged(ids).float()
        with adapters_disabled(policy):
            base = policy(ids).float()
    # bf16: the merged weights are rounded once, the adapter path adds an fp32 delta to a bf16 output
    assert (adapted - plain).abs().max() < 0.1 * (adapted - base).abs().max()


@pytest.mark.gpu
def test_grpo_with_lora_on_cuda_in_bf16(tmp_path, toy_base):
    cfg, trainer, metrics = _rl(tmp_path, "train.yaml", toy_base, 2, "--grpo.kl_coef=0.01",
                                "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.precision=bf16-mixed",
                                "--model.policy.dtype=bfloat16")
    module = trainer.lightning_module
    assert module.policy.lm_head_weight.dtype == torch.bfloat16
    assert {p.dtype for p in module.policy.parameters() if p.requires_grad} == {torch.float32}
    kl = [r["policy/ref_kl"] for r in metrics]
    assert kl[0] == 0.0 and kl[-1] > 0
    _only_adapters_changed(cfg, module)


_ALLOCATED: list[int] = []


class AllocatedAtStepEnd(lightning.pytorch.Callback):
    """Records the allocator's allocated bytes at the end of every training step in _ALLOCATED."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        _ALLOCATED.append(torch.cuda.memory_allocated())


@pytest.mark.gpu
def test_grpo_with_lora_on_cuda_keeps_no_memory_from_one_rollout_to_the_next(tmp_path, toy_base):
    """With adapters the engine captures its decode graphs again at every rollout (they read that call's autocast
    casts). The captures ran on a new stream each, and cuBLAS kept a workspace of each stream for good: every
    rollout left memory allocated."""
    _ALLOCATED.clear()
    _rl(tmp_path, "train.yaml", toy_base, 6, "--trainer.accelerator=gpu", "--trainer.devices=1",
        "--trainer.precision=bf16-mixed", "--model.policy.dtype=bfloat16",
        "--callbacks=[{class_path: test_lora.AllocatedAtStepEnd}]")
    assert len(_ALLOCATED) == 6
    # under 16 MiB, where a cuBLAS workspace is 32
    assert _ALLOCATED[-1] - _ALLOCATED[1] < 2**24, [a / 2**20 for a in _ALLOCATED]
