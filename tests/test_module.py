"""FwModule: LR schedules, optimizer setup, the SFT loss / clipping against an independent computation,
checkpoint components in HF layout, and the metrics aggregation."""

import copy
import math
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from framework import checkpoint as ck
from framework.callbacks import Callback
from framework.config import resolve
from framework.data import IGNORE, sft_dataloader
from framework.errors import FwError
from framework.metrics import StepMetrics, read_metrics
from framework.module import FwModule
from framework.recipe import POLICY, OptimizerRole, Requirements
from framework.schedule import LRSchedule
from framework.trainer import fit
from recipes.sft import SFTRecipe

ROOT = Path(__file__).parents[1]

DATA = "recipes/data/arithmetic_chat.jsonl"


def ppo_cfg(tmp_path, **over):
    cfg = {"recipe": "ppo", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"task": {"name": "digits", "init_args": {"num_digits": 1}}, "chat_template": False},
           "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return resolve(cfg)


def sft_cfg(tmp_path, **over):
    cfg = {"recipe": "sft", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": DATA, "max_seq_len": 96, "batch_size": 3},
           "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
           "logging": {"csv": False, "tensorboard": False}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return resolve(cfg)


# ------------------------------------------------------------------ LR schedules
def test_lr_schedules_by_hand():
    # warmup 4 of 14 steps: (s+1)/4 for s < 4, then decay over the remaining 10 steps.
    const = LRSchedule("constant", 4, 14, 0.5)
    assert [const(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lin = LRSchedule("linear", 4, 14, 0.0)
    assert [lin(s) for s in (3, 4, 9, 14, 20)] == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])
    lin_floor = LRSchedule("linear", 0, 10, 0.2)
    assert [lin_floor(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.6, 0.2])
    cos = LRSchedule("cosine", 0, 8, 0.1)
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi * s / 8))
    assert cos(0) == pytest.approx(1.0)
    assert cos(2) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert cos(4) == pytest.approx(0.55)
    assert cos(8) == pytest.approx(0.1)


def test_resumed_schedule_follows_the_config(tmp_path):
    """The scheduler checkpoint holds the step count only: resuming with a longer max_steps stretches
    the decay (the new config's schedule at the restored step)."""
    module = FwModule(sft_cfg(tmp_path, scheduler={"name": "linear"}, optimizer={"lr": 1.0},
                              trainer={"max_steps": 10}))
    (opt,), (sched,) = module.configure_optimizers()
    for _ in range(4):
        opt.step()
        sched["scheduler"].step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6)
    longer = FwModule(sft_cfg(tmp_path, scheduler={"name": "linear"}, optimizer={"lr": 1.0},
                              trainer={"max_steps": 20}))
    (opt2,), (sched2,) = longer.configure_optimizers()
    opt2.load_state_dict(opt.state_dict())
    sched2["scheduler"].load_state_dict(sched["scheduler"].state_dict())
    opt2.step()
    sched2["scheduler"].step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(1 - 5 / 20)


def test_optimizer_groups_and_fused_auto(tmp_path):
    module = FwModule(sft_cfg(tmp_path, optimizer={"weight_decay": 0.1, "lr": 2e-3, "betas": [0.8, 0.9]}))
    opts, scheds = module.configure_optimizers()
    (opt,) = opts
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.policy.parameters()))
    assert opt.defaults["fused"] is False   # auto: fused only on CUDA
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["lr"] == 2e-3
    assert scheds[0]["interval"] == "step"


def test_float16_weights_take_the_fused_step_which_matches_float64_adamw(tmp_path):
    """model.policy.dtype: float16. AdamW's eps (1e-8) is 0 in float16, so torch's unfused step makes 0 / 0 of every
    weight whose gradient is 0 (the embedding rows of tokens a batch lacks); `auto` takes the fused step, which
    computes in float32, on the CPU too. Its first step equals float64 AdamW's to float16 rounding."""
    module = FwModule(sft_cfg(tmp_path, model={"policy": {"preset": "tiny", "dtype": "float16"}},
                              optimizer={"lr": 1e-2, "weight_decay": 0.1}))
    (opt,), _ = module.configure_optimizers()
    assert opt.defaults["fused"] is True
    g = torch.Generator().manual_seed(0)
    params, ref_groups = [], []
    for group in opt.param_groups:
        params += group["params"]
        ref_groups.append({"params": [p.detach().double() for p in group["params"]],
                           **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}})
    ref_opt = torch.optim.AdamW(ref_groups)
    reference = [r for group in ref_groups for r in group["params"]]
    assert params[0] is module.policy.model.embed_tokens.weight
    for i, (p, r) in enumerate(zip(params, reference, strict=True)):
        p.grad = torch.randn(p.shape, generator=g).half()
        if i == 0:
            p.grad[: len(p) // 2] = 0   # embedding rows of tokens the batch does not hold
        r.grad = p.grad.double()
    opt.step()
    ref_opt.step()
    for p, r in zip(params, reference, strict=True):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.double(), r, rtol=2**-10, atol=2**-24)


def test_float16_weights_train_without_nan(tmp_path):
    fit(sft_cfg(tmp_path, model={"policy": {"preset": "tiny", "dtype": "float16"}}, trainer={"max_steps": 3}))
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)


def test_lora_critic_trains_in_float32_on_a_bfloat16_base(tmp_path):
    """PPO with LoRA on a bfloat16 base under bf16-mixed: the critic, which trains every weight, holds the base's
    weights in float32, as the adapters are float32, so the first AdamW step at lr 1e-5 moves every weight by
    lr * sign(gradient) (Adam's first step), which bfloat16 weights of the critic would mostly round away."""
    from framework.models.lora import adapters_detached

    module = FwModule(ppo_cfg(tmp_path, model={"policy": {"preset": "tiny", "dtype": "bfloat16", "lora": {}}},
                              trainer={"precision": "bf16-mixed"}, ppo={"critic": {"lr": 1e-5}}))
    with adapters_detached(module.policy):
        base = module.policy.model.state_dict()
    assert {p.dtype for p in module.value.parameters()} == {torch.float32}
    trunk = module.value.model.state_dict()
    assert trunk.keys() == base.keys() and all(torch.equal(trunk[k], base[k].float()) for k in base)
    (_, critic_opt), _ = module.configure_optimizers()
    before = {n: p.detach().clone() for n, p in module.value.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for p in module.value.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    critic_opt.step()
    for n, p in module.value.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), 1e-5 * p.grad.sign(), rtol=0, atol=1e-7, msg=n)


def saved_numel(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Elements the autograd graph of one training forward keeps for the backward."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return count


@pytest.mark.parametrize("mode", [True, "selective"])
def test_the_critic_recomputes_as_the_policy_does_whatever_its_source(tmp_path, mode):
    """model.policy.gradient_checkpointing applies to the critic (fw plan counts it so) whether the critic starts
    from the policy's trunk, from a value model directory or from another language model's directory: its training
    forward keeps fewer values for the backward than the same critic without recomputation."""
    from framework.models import save_pretrained, save_value_model

    policy = {"preset": "tiny", "gradient_checkpointing": mode}
    first = FwModule(ppo_cfg(tmp_path, model={"policy": policy}))
    save_value_model(first.value, tmp_path / "critic")
    save_pretrained(first.policy, tmp_path / "lm")
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    for source in (None, tmp_path / "critic", tmp_path / "lm"):
        module = first if source is None else FwModule(ppo_cfg(tmp_path, model={"policy": policy,
                                                                                "value": {"path": str(source)}}))
        critic = module.value.train()
        kept = saved_numel(critic, ids)
        critic.gradient_checkpointing = False
        assert kept < saved_numel(critic, ids), source


@pytest.mark.parametrize("key, kind", [("model.reference.path", "lm"), ("model.value.path", "lm"),
                                       ("model.value.path", "critic")])
def test_a_reference_or_critic_smaller_than_the_tokenizer_is_refused(tmp_path, key, kind):
    """A model whose embedding holds fewer ids than the tokenizer has (20 against the built-in tokenizer's) would
    fail with an IndexError after the first rollout: refused when the module is built, naming the key."""
    from framework.models import Qwen3Config, Qwen3ForCausalLM, Qwen3ValueModel, save_pretrained, save_value_model
    from framework.tokenizer import Tokenizer

    small = Qwen3Config.from_hf({"vocab_size": 20, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                 "tie_word_embeddings": True})
    path = tmp_path / "model"
    if kind == "critic":
        save_value_model(Qwen3ValueModel(small), path)
    else:
        save_pretrained(Qwen3ForCausalLM(small), path)
    if key == "model.reference.path":
        cfg = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}, "reference": {"path": str(path)}},
                       "data": {"task": {"name": "digits"}}, "grpo": {"kl_coef": 0.1}})
    else:
        cfg = ppo_cfg(tmp_path, model={"policy": {"preset": "tiny"}, "value": {"path": str(path)}})
    with pytest.raises(FwError) as e:
        FwModule(cfg)
    tokens = Tokenizer.builtin().vocab_size
    assert str(e.value) == f"{key}: the tokenizer has {tokens} tokens but the model's vocab_size is 20"


# ------------------------------------------------- loss and clipping vs reference
def reference_step(module, batch, max_norm):
    """Independent SFT loss (full-vocab cross-entropy on the shifted targets) and gradient norm."""
    policy = copy.deepcopy(module.policy)
    logits = policy(batch["input_ids"], position_ids=batch["position_ids"]).double()
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE)
    loss.backward()
    grads = [p.grad.double() for p in policy.parameters()]
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    accuracy = (logits.argmax(-1) == batch["targets"]).sum() / (batch["targets"] != IGNORE).sum()
    return loss.item(), norm.item(), accuracy.item(), [g * min(1.0, max_norm / norm.item()) for g in grads]


def test_first_step_matches_reference_and_clips(tmp_path):
    cfg = sft_cfg(tmp_path, optimizer={"max_grad_norm": 0.1, "lr": 1e-3}, trainer={"max_steps": 1})
    torch.manual_seed(cfg["seed"])
    probe = FwModule(cfg)   # same seed as fit's: same initial weights
    first = next(iter(sft_dataloader(probe.recipe.stream, 0, cfg, probe.tokenizer.pad_id, 0, 1)))
    loss, norm, accuracy, clipped = reference_step(probe, first, 0.1)
    trainer = fit(cfg)
    module = trainer.lightning_module
    (m,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert m["step"] == 1
    assert m["loss"] == pytest.approx(loss, rel=1e-5)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert m["token_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert m["tokens"] == first["num_tokens"]
    assert m["lr"] == 1e-3
    assert norm > 0.1   # so clipping was active
    # AdamW's first step moves each weight by ~lr * sign(grad): check the direction matches the clipped
    # reference gradient wherever the gradient is clearly non-zero.
    for p0, p1, g in zip(probe.policy.parameters(), module.policy.parameters(), clipped):
        moved = (p1.detach().double() - p0.detach().double())
        big = g.abs() > 1e-6
        assert torch.equal(torch.sign(moved[big]), -torch.sign(g[big]))


# ------------------------------------------------------------- checkpoints
def test_checkpoint_components_round_trip(tmp_path):
    cfg = sft_cfg(tmp_path)
    torch.manual_seed(0)
    a = FwModule(cfg)
    a.policy_version = 7
    a.recipe.position = 42
    checkpoint = {"state_dict": a.state_dict()}
    a.on_save_checkpoint(checkpoint)
    assert not any(k.startswith("policy.") for k in checkpoint["state_dict"])
    comp = checkpoint["fw_components"]["policy"]
    hf = a.policy.hf_state_dict()
    assert set(comp["state_dict"]) == set(hf)
    assert "model.layers.0.self_attn.q_proj.weight" in comp["state_dict"]   # HF names, unfused
    for k, v in comp["state_dict"].items():
        assert torch.equal(v, hf[k])
        # views of the module's own tensors: the writer streams them, nothing is copied to the host first
        assert v.untyped_storage().data_ptr() == hf[k].untyped_storage().data_ptr()
    assert comp["config"]["model_type"] == "qwen3" and comp["config"]["hidden_size"] == 64
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(comp["files"])
    assert checkpoint["policy_version"] == 7 and checkpoint["fw_recipe"] == {"position": 42}

    torch.manual_seed(1)
    b = FwModule(cfg)
    assert not torch.equal(b.policy.lm_head_weight, a.policy.lm_head_weight)
    b.on_load_checkpoint(checkpoint)
    b.load_state_dict(checkpoint["state_dict"])   # what Lightning does next
    for (ka, va), (kb, vb) in zip(a.policy.state_dict().items(), b.policy.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert b.policy_version == 7 and b.recipe.position == 42


def test_checkpoint_without_weights_fails_loudly(tmp_path):
    from framework.errors import FwError

    module = FwModule(sft_cfg(tmp_path))
    with pytest.raises(FwError, match="no policy weights"):
        module.on_load_checkpoint({"state_dict": {}})
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    del checkpoint["fw_components"]["policy"]["state_dict"]["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(FwError, match=r"checkpoint policy/: missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        module.on_load_checkpoint(checkpoint)


# ------------------------------------------------------------------ metrics
def test_step_metrics_weighted_mean_sum_max_last_and_state():
    m = StepMetrics()
    m.update("loss", 2.0, weight=1)
    m.update("loss", 5.0, weight=3)
    m.update("tokens", 10, reduce="sum")
    m.update("tokens", 7, reduce="sum")
    m.update("peak", 1.0, reduce="max")
    m.update("peak", 4.0, reduce="max")
    m.update("lr", 0.1, reduce="last")
    m.update("lr", 0.2, reduce="last")
    saved = m.state()
    out = m.compute()
    assert out == {"loss": pytest.approx((2 + 15) / 4), "tokens": 17.0, "peak": 4.0, "lr": 0.2}
    assert m.compute() == {}   # reset after compute
    restored = StepMetrics()
    restored.load_state(saved)
    restored.update("loss", 1.0, weight=4)
    assert restored.compute()["loss"] == pytest.approx((2 + 15 + 4) / 8)
    with pytest.raises(ValueError, match="reduce"):
        m.update("loss", 1.0, reduce="median")


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_step_metrics_accumulate_in_float64_under_a_16_bit_default_dtype(precision):
    """Lightning's -true precisions make a 16-bit type torch's default dtype inside training_step, where metrics
    are first logged, and convert the module, with the metrics a checkpoint restored, to that type: the sums,
    means and extremes are float64 all the same, and so is a state saved by an older run in bfloat16 once
    loaded."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    m = StepMetrics()
    with HalfPrecision(precision).forward_context():
        assert torch.get_default_dtype() in (torch.bfloat16, torch.float16)
        for _ in range(301):
            m.update("count", 1.0, reduce="sum")
            m.update("tokens", 70_001.0, reduce="sum")   # past float16's largest value
        m.update("loss", 0.123456789, weight=1)
        m.update("loss", 2.5, weight=3)
        m.update("peak", 16_790.25, reduce="max")
        m.update("low", 0.987654321, reduce="min")
        saved = m.state()
    assert m.compute() == {"count": 301.0, "tokens": 301 * 70_001.0, "loss": pytest.approx((0.123456789 + 7.5) / 4,
                                                                                            rel=1e-15),
                           "peak": 16_790.25, "low": 0.987654321}
    saved["metrics"]["loss"]["state"] = {k: v.to(torch.bfloat16) for k, v in saved["metrics"]["loss"]["state"].items()}
    restored = StepMetrics()
    restored.load_state(saved)
    restored.to(torch.bfloat16)   # the precision plugin's convert_module, which runs after the restore
    restored.update("loss", 0.1, weight=1)
    restored.update("peak", 16_790.25, reduce="max")
    assert restored.compute()["peak"] == 16_790.25
    restored.load_state(saved)
    restored.update("loss", 0.1, weight=1)
    bf16_weighted_sum = float(torch.tensor(0.123456789 + 7.5, dtype=torch.bfloat16))
    assert restored.compute()["loss"] == pytest.approx((bf16_weighted_sum + 0.1) / 5, rel=1e-15)


def test_grpo_under_bf16_true_logs_metrics_at_full_precision(tmp_path):
    """A real GRPO fit under bf16-true on the CPU: the logged rollout time is the measured float, not one of the
    values a bfloat16 can hold."""
    pytest.importorskip("torchao")   # bfloat16 weights train with stochastic rounding
    fit(resolve({"recipe": "grpo", "seed": 3, "run_dir": str(tmp_path / "run"),
                 "model": {"policy": {"preset": "tiny", "dtype": "bfloat16"}},
                 "optimizer": {"stochastic_rounding": True},
                 "data": {"task": {"name": "digits"}}, "reward": {"name": "numeric_match"},
                 "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "grpo": {"group_size": 2},
                 "trainer": {"accelerator": "cpu", "max_steps": 3, "precision": "bf16-true",
                             "enable_progress_bar": False, "log_every_n_steps": 1},
                 "checkpoint": {"every_n_steps": 1000}, "logging": {"csv": False, "tensorboard": False}}))
    seconds = [r["rollout/seconds"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(seconds) == 3
    assert all(float(torch.tensor(v, dtype=torch.bfloat16)) != v for v in seconds), seconds


def test_metrics_logged_every_n_steps_and_at_the_end(tmp_path):
    fit(sft_cfg(tmp_path, trainer={"max_steps": 5, "log_every_n_steps": 2}))
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [2, 4, 5]
    assert all("token_accuracy" in m and "loss" in m for m in metrics)


class WithCritic(SFTRecipe):
    """SFT data + a value model: enough to exercise the critic's checkpoint component."""

    @classmethod
    def requirements(cls, cfg):
        return Requirements(automatic_optimization=True, value_model=True)

    def __init__(self, cfg, tokenizer):
        super().__init__({**cfg, "sft": {"train_on_prompt": False}}, tokenizer)


def test_value_component_round_trip(tmp_path, install_recipe):
    from framework.errors import FwError

    install_recipe({"sft_with_critic": "test_module:WithCritic"})
    cfg = resolve({"recipe": "sft_with_critic", "model": {"policy": {"preset": "tiny"}}, "data": {"path": DATA}})
    a = FwModule(cfg)
    with torch.no_grad():
        a.value.v_head.weight.normal_()
    checkpoint = {"state_dict": a.state_dict()}
    a.on_save_checkpoint(checkpoint)
    value = checkpoint["fw_components"]["value"]
    assert value["config"]["architectures"] == ["Qwen3ValueModel"]
    assert set(value["state_dict"]) == set(a.value.hf_state_dict()) and "v_head.weight" in value["state_dict"]
    b = FwModule(cfg)
    restored = copy.deepcopy(checkpoint)
    b.on_load_checkpoint(restored)
    b.load_state_dict(restored["state_dict"])
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    del checkpoint["fw_components"]["value"]
    with pytest.raises(FwError, match="no value/ component"):
        b.on_load_checkpoint(checkpoint)


def test_accumulation_is_the_exact_token_mean_of_the_step(tmp_path):
    """2 micro-batches of 2 rows train exactly like 1 batch of 4 rows (packed rows are the same)."""
    runs = {}
    for name, (accumulate, rows) in {"acc": (2, 2), "one": (1, 4)}.items():
        cfg = sft_cfg(tmp_path / name, trainer={"max_steps": 3, "accumulate_grad_batches": accumulate},
                      data={"batch_size": rows}, optimizer={"lr": 3e-3, "max_grad_norm": None})
        fit(cfg)
        runs[name] = read_metrics(tmp_path / name / "run" / "metrics.jsonl")
    for a, b in zip(runs["acc"], runs["one"], strict=True):
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "grad_norm", "token_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)


@pytest.mark.gpu
def test_step_metrics_live_on_the_module_device():
    # NCCL reduces only CUDA tensors: a metric first logged as a Python float must still live on the GPU,
    # and so must one restored from a checkpoint's interval state.
    metrics = StepMetrics().cuda()
    metrics.update("tokens", 12.0, reduce="sum")
    metrics.update("loss", 0.5)
    restored = StepMetrics().cuda()
    restored.load_state(metrics.state())
    assert {m.device.type for s in (metrics, restored) for m in s.metrics.values()} == {"cuda"}
    assert restored.compute() == {"tokens": 12.0, "loss": 0.5}


def test_a_nan_metric_stops_the_run_naming_it():
    metrics = StepMetrics()
    metrics.update("grad_norm", float("inf"))   # an fp16 step skipped by loss scaling: not an error
    assert metrics.compute() == {"grad_norm": float("inf")}
    # found at the logging step's compute(): update() does not wait for the device
    metrics.update("undefined", 0.0, weight=0.0)   # a mean of no weight is no value: left out, not NaN
    metrics.update("share", 3.0, weight=0.0)
    metrics.update("share", 5.0, weight=2.0)
    assert metrics.compute() == {"share": 5.0}
    for name, reduce in (("loss", "mean"), ("tokens", "sum"), ("mismatch/max", "max")):
        metrics.update("ok", 1.0)
        metrics.update(name, torch.tensor([float("nan")]).sum(), reduce=reduce)
        with pytest.raises(FwError, match=f"metric '{name}' is NaN: the run has diverged"):
            metrics.compute()


def test_a_nan_that_user_code_logged_names_its_call_not_a_divergence():
    """A NaN of user code's own metric says nothing about the training: the error names the call that logged it."""
    metrics = StepMetrics()
    metrics.update("user/ratio", 0.5, user=True, site="my_cb.py:12")
    assert metrics.compute() == {"user/ratio": 0.5}
    metrics.update("loss", 1.0)
    metrics.update("user/ratio", float("nan"), user=True)
    with pytest.raises(FwError) as e:
        metrics.compute()
    assert str(e.value) == ("metric 'user/ratio' is NaN, a value user code logged (module.log_metric at "
                            "my_cb.py:12); log finite values only")


def _nan_on_one_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    metrics = StepMetrics()
    metrics.update("loss", float("nan") if rank == 1 else 1.0)
    try:
        metrics.compute()
        result = "no error"
    except FwError as e:
        result = str(e)
    with open(f"{out}.{rank}", "w") as f:
        f.write(result)
    dist.destroy_process_group()


def test_a_nan_on_one_rank_stops_every_rank(tmp_path):
    """The NaN flags are reduced over the ranks with the values: the rank that saw none stops at the same step
    instead of writing the diverged step's record and then dying in the next collective."""
    from scripts.preloaded import run_ranks

    out = str(tmp_path / "result")
    run_ranks(_nan_on_one_rank, f"file://{tmp_path / 'init'}", out)
    for rank in (0, 1):
        text = Path(f"{out}.{rank}").read_text()
        assert text.startswith("metric 'loss' is NaN: the run has diverged"), (rank, text)


def test_metric_names_come_back_as_logged():
    metrics = StepMetrics()
    metrics.update("reward/format.score", 1.0)
    metrics.update("my__metric", 2.0)
    assert metrics.compute() == {"reward/format.score": 1.0, "my__metric": 2.0}
    metrics.update("loss.a", 1.0)
    with pytest.raises(ValueError, match=r"log_metric\('loss__a'\): 'loss.a' is logged too, and the two cannot"):
        metrics.update("loss__a", 3.0)
    restored = StepMetrics()
    restored.load_state(metrics.state())   # a checkpoint mid-interval keeps the name
    assert restored.compute() == {"loss.a": 1.0}
    with pytest.raises(ValueError, match=r"log_metric\('v'\): reduce='last' takes one value, got a tensor of shape"):
        metrics.update("v", torch.ones(3), reduce="last")


def test_read_metrics_leaves_out_a_torn_last_line_and_names_a_bad_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')   # killed mid-write
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(FwError, match=rf"^{path}:2: not a metrics record"):
        read_metrics(path)


@pytest.mark.parametrize("roles, value_model, automatic, message", [
    ((OptimizerRole("critic", "value", ("optimizer",)),), True, False, "exactly one optimizer role trains the policy"),
    ((POLICY, OptimizerRole("policy", "value", ("optimizer",))), True, False, "repeat a name"),
    ((OptimizerRole("policy", "value", ("optimizer",)),), True, False, "exactly one optimizer role trains the policy"),
    ((POLICY, OptimizerRole("critic", "value", ("optimizer",))), False, False, "value_model is False"),
    ((POLICY, OptimizerRole("critic", "critic", ("optimizer",))), True, False, "model is 'policy' or 'value'"),
    ((POLICY, OptimizerRole("critic", "value", ("optimizer",))), True, True, "automatic optimization steps one"),
])
def test_requirements_refuse_optimizer_roles_that_cannot_train(roles, value_model, automatic, message):
    with pytest.raises(FwError, match=f"recipe requirements: .*{message}"):
        Requirements(automatic_optimization=automatic, optimizers=roles, value_model=value_model)


class CriticWithoutSection(WithCritic):
    @classmethod
    def requirements(cls, cfg):
        critic = OptimizerRole("critic", "value", ("critic_settings",))
        return Requirements(automatic_optimization=False, optimizers=(POLICY, critic), value_model=True)


def test_an_optimizer_role_needs_its_config_section(install_recipe):
    install_recipe({"no_section": "test_module:CriticWithoutSection"})
    cfg = resolve({"recipe": "no_section", "model": {"policy": {"preset": "tiny"}}, "data": {"path": DATA}})
    with pytest.raises(FwError, match="optimizer role 'critic' reads lr, weight_decay and max_grad_norm from "
                                      "config section critic_settings, which this config does not hold"):
        FwModule(cfg)


@pytest.mark.parametrize("name", ["step", ""])
def test_a_metric_cannot_take_the_records_step_key_or_no_name(name):
    """metrics.jsonl keys each record by "step" (a resume truncates the file after the checkpoint's step): a metric
    of that name would overwrite it, and a resume would then delete the records it mislabelled."""
    m = StepMetrics()
    for reduce in ("mean", "last"):
        with pytest.raises(ValueError, match=r"log_metric\(.*\): a metric needs a non-empty name other than 'step'"):
            m.update(name, 1.0, reduce=reduce)
    m.update("steps", 1.0)
    assert m.compute() == {"steps": 1.0}


def test_user_code_cannot_log_under_a_name_fw_writes():
    """A user value under one of fw's names would be merged into fw's value (a mean of the two, a sum, the later of
    two `last` values) with no word: it is refused, with the name and what to do, at whichever write comes second,
    and fw's value stays as fw logged it."""
    m = StepMetrics()
    m.update("loss", 2.0)
    m.update("lr", 0.5, reduce="last")
    for name, reduce in (("loss", "mean"), ("loss", "sum"), ("lr", "last")):
        with pytest.raises(ValueError, match=rf"^log_metric\('{name}'\): fw writes '{name}' itself, and a value "
                                             rf"logged under its name would be merged into fw's; log yours under a "
                                             rf"name of its own, e.g. 'user/{name}'$"):
            m.update(name, 100.0, reduce=reduce, user=True)
    # what fw writes into a record outside StepMetrics, and the evaluation's metrics, before fw writes them
    for name in ("tokens_per_s", "memory/peak_gib", "memory/mine", "eval/accuracy", "eval/my_metric"):
        with pytest.raises(ValueError, match=rf"fw writes '{name}' itself"):
            m.update(name, 1.0, user=True)
    m.update("user/loss", 7.0, user=True)
    m.update("user/loss", 9.0, user=True)
    m.update("evaluation", 3.0, user=True)
    assert m.compute() == {"loss": 2.0, "lr": 0.5, "user/loss": 8.0, "evaluation": 3.0}
    # the names stay fw's and the user's for the rest of the run: here user code logs first
    with pytest.raises(ValueError, match=r"fw writes 'loss' itself"):
        m.update("loss", 1.0, user=True)
    m.update("user/acc", 1.0, user=True, site="my_callbacks.py:12")
    with pytest.raises(FwError, match=r"^metrics: fw writes 'user/acc' itself, and user code logged it "
                                      r"earlier in the run \(module.log_metric at my_callbacks.py:12\), so the two "
                                      r"values would be merged; log yours under a name of its own, e.g. "
                                      r"'user/user/acc'$"):
        m.update("user/acc", 1.0)
    m.update("loss", 4.0)
    assert m.compute() == {"loss": 4.0, "user/acc": 1.0}


class LogsUnderFwNames(Callback):
    """Before every policy step after the first, logs a value under each name of fw's latest record and latest eval,
    and one of its own; keeps the names that were not refused."""

    accepted: ClassVar[list] = []
    tried: ClassVar[set] = set()

    def before_optimizer_step(self, trainer, module, optimizer):
        for name in [*module.last_metrics, *module.last_eval_metrics]:
            if name == "user/probe":
                continue
            self.tried.add(name)
            try:
                module.log_metric(name, -1e9)
            except ValueError as e:
                assert f"fw writes '{name}' itself" in str(e)
            else:
                self.accepted.append(name)
        module.log_metric("user/probe", 7.0)


def test_a_callback_is_refused_every_name_fw_writes_in_a_real_run(tmp_path):
    """A GRPO run with eval: fw's own metrics (the recipe's, lr, grad_norm, tokens_per_s, eval/*) pass, and a
    callback's log_metric of any name fw wrote is refused, so no record holds its value."""
    cfg = resolve({"recipe": "grpo", "seed": 2, "run_dir": str(tmp_path / "run"),
                   "model": {"policy": {"preset": "tiny"}}, "data": {"task": {"name": "digits"}},
                   "reward": {"name": "numeric_match"},
                   "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "grpo": {"group_size": 2},
                   "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "enable_progress_bar": False,
                               "log_every_n_steps": 1},
                   "eval": {"every_n_steps": 1, "held_out": False, "max_prompts": 2, "samples_per_prompt": 2},
                   "checkpoint": {"every_n_steps": 1000}, "logging": {"csv": False, "tensorboard": False},
                   "callbacks": [{"class_path": "test_module.LogsUnderFwNames"}]})
    LogsUnderFwNames.accepted, LogsUnderFwNames.tried = [], set()
    fit(cfg)
    assert LogsUnderFwNames.accepted == []
    assert {"policy/loss", "lr", "grad_norm", "reward/mean", "tokens_per_s",
            "eval/accuracy"} <= LogsUnderFwNames.tried
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r.get("user/probe") for r in records] == [7.0, 7.0, 7.0]
    assert not [(r["step"], k) for r in records for k, v in r.items() if v == -1e9]


class LogsTokenAccuracy(Callback):
    """Logs `token_accuracy`, a name the SFT recipe writes only at the steps it logs, after every policy step."""

    def before_optimizer_step(self, trainer, module, optimizer):
        module.log_metric("token_accuracy", 0.5)


def test_fw_refuses_its_later_write_of_a_name_user_code_logged_first_with_one_line(tmp_path):
    """The SFT recipe first writes token_accuracy at step 3 (log_every_n_steps 3), after the callback's steps 1 and 2:
    the run stops there with an FwError (one line, exit code 2) that names the callback's call, the code at fault,
    not with a traceback through fw's recipe."""
    cfg = resolve({"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / "run"),
                   "model": {"policy": {"preset": "tiny"}},
                   "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 96,
                            "batch_size": 2},
                   "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 6, "enable_progress_bar": False,
                               "log_every_n_steps": 3},
                   "checkpoint": {"every_n_steps": 2}, "logging": {"csv": False, "tensorboard": False},
                   "callbacks": [{"class_path": "test_module.LogsTokenAccuracy"}]})
    with pytest.raises(FwError) as info:
        fit(cfg)
    line = LogsTokenAccuracy.before_optimizer_step.__code__.co_firstlineno + 1
    assert str(info.value) == (
        "metrics: fw writes 'token_accuracy' itself, and user code logged it earlier in the run "
        f"(module.log_metric at {__file__}:{line}), so the two values would be merged; log yours under a name of its "
        "own, e.g. 'user/token_accuracy'")
    assert sorted(p.name for p in ck.checkpoints_dir(tmp_path / "run").iterdir()) == [ck.step_dir_name(2)]
