"""Review of the optimizers, the LR schedule and LoRA against independent references: the lr each step trains at
(hand values for the schedule's end points), PPO's critic outside the schedule, torch's AdamW over fw's parameter
groups against AdamW written out in float64, and LoRA's adapters against PEFT on transformers' Qwen3 (gradients,
the merged model, the initialisation)."""

import math

import pytest
import torch
from test_lora import peft_twin
from test_module import sft_cfg

from framework.config import resolve
from framework.errors import FwError
from framework.models import build_policy
from framework.models.lora import adapters_disabled, merged_copy, peft_targets
from framework.module import FwModule
from framework.optim import build_optimizer
from framework.tokenizer import Tokenizer

DATA = "recipes/data/arithmetic_chat.jsonl"


# ------------------------------------------------------------------------------------------ the LR schedule
def trained_lrs(tmp_path, name, warmup, max_steps, min_lr_ratio):
    """The lr of every parameter group at each of `max_steps` optimizer steps, then the lr after the last one,
    through the module's own optimizer and scheduler (lr 1: the values are the multipliers)."""
    module = FwModule(sft_cfg(tmp_path, optimizer={"lr": 1.0},
                              scheduler={"name": name, "warmup_steps": warmup, "min_lr_ratio": min_lr_ratio},
                              trainer={"max_steps": max_steps}))
    (opt,), (sched,) = module.configure_optimizers()
    assert len(opt.param_groups) == 2
    lrs = []
    for _ in range(max_steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched["scheduler"].step()
    return lrs, [g["lr"] for g in opt.param_groups]


HALF_COS = 0.5 * (1 + math.cos(math.pi / 4))   # 0.8535...


@pytest.mark.parametrize("name, warmup, max_steps, floor, want, after", [
    # step k of the first warmup_steps trains at k / warmup_steps; the decay starts at the full lr the step after
    ("linear", 2, 6, 0.2, [0.5, 1.0, 1.0, 0.8, 0.6, 0.4], 0.2),
    # warmup 0: the first step at the full lr, the last one step of decay above min_lr_ratio (0)
    ("linear", 0, 4, 0.0, [1.0, 0.75, 0.5, 0.25], 0.0),
    ("cosine", 1, 5, 0.1, [1.0, 1.0, 0.1 + 0.9 * HALF_COS, 0.55, 0.1 + 0.9 * (1 - HALF_COS)], 0.1),
    # warmup as long as the run: the last step at the full lr, no decay
    ("cosine", 4, 4, 0.0, [0.25, 0.5, 0.75, 1.0], 1.0),
    # warmup longer than the run: it never reaches the full lr
    ("linear", 8, 4, 0.0, [0.125, 0.25, 0.375, 0.5], 0.625),
    ("constant", 0, 3, 0.5, [1.0, 1.0, 1.0], 1.0),   # min_lr_ratio is for the decays only
])
def test_each_step_trains_at_the_documented_lr(tmp_path, name, warmup, max_steps, floor, want, after):
    lrs, last = trained_lrs(tmp_path, name, warmup, max_steps, floor)
    assert lrs == [pytest.approx([w, w], rel=1e-12, abs=1e-15) for w in want]
    assert last == pytest.approx([after, after], rel=1e-12, abs=1e-15)


def test_ppo_critic_keeps_its_own_lr_while_the_policy_follows_the_schedule(tmp_path):
    cfg = resolve({"recipe": "ppo", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "digits", "init_args": {"num_digits": 1}}, "chat_template": False},
                   "optimizer": {"lr": 1.0, "weight_decay": 0.3, "betas": [0.8, 0.9], "eps": 1e-6},
                   "ppo": {"critic": {"lr": 0.25, "weight_decay": 0.05}},
                   "scheduler": {"name": "linear", "warmup_steps": 2},
                   "trainer": {"accelerator": "cpu", "max_steps": 4, "enable_progress_bar": False}})
    module = FwModule(cfg)
    (policy, critic), (sched,) = module.configure_optimizers()
    assert sched["scheduler"].optimizer is policy
    assert [g["weight_decay"] for g in critic.param_groups] == [0.05, 0.0]
    assert {(g["betas"], g["eps"]) for g in critic.param_groups} == {((0.8, 0.9), 1e-6)}
    seen = []
    for _ in range(4):
        seen.append(([g["lr"] for g in policy.param_groups], [g["lr"] for g in critic.param_groups]))
        policy.step()
        critic.step()
        sched["scheduler"].step()
    assert seen == [([p, p], [0.25, 0.25]) for p in (0.5, 1.0, 1.0, 0.5)]


# ------------------------------------------------------------------------------------------ AdamW
class Tied(torch.nn.Module):
    """An embedding tied to the output layer, a linear layer with a bias and a norm gain: every kind of parameter
    that fw's groups tell apart."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(11, 6, generator=g))
        self.head = torch.nn.Module()
        self.head.weight = self.embed
        self.proj = torch.nn.Linear(6, 5)
        self.gain = torch.nn.Parameter(torch.rand(6, generator=g) + 0.5)
        self.frozen = torch.nn.Parameter(torch.randn(4, 4, generator=g), requires_grad=False)


def adamw_float64(p, m, v, t, g, lr, betas, eps, decay):
    """One AdamW step written out (decoupled decay, bias-corrected moments) in float64."""
    b1, b2 = betas
    p = p * (1 - lr * decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps), m, v


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_follows_float64_adamw_with_decay_on_matrices_only(fused):
    """Five steps at changing lrs, a parameter without a gradient at one step (it neither decays nor counts the
    step): the tied embedding and the linear weight decay, the bias and the gain do not, the frozen weight is
    left out, and betas and eps are the config's."""
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": {"path": "x.jsonl"},
                   "optimizer": {"lr": 1e-2, "weight_decay": 0.2, "betas": [0.7, 0.9], "eps": 1e-3,
                                 "fused": fused}})
    model = Tied()
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    params = {"embed": model.embed, "proj.weight": model.proj.weight, "proj.bias": model.proj.bias,
              "gain": model.gain}
    assert sorted(id(p) for g in opt.param_groups for p in g["params"]) == sorted(id(p) for p in params.values())
    decays = {"embed": 0.2, "proj.weight": 0.2, "proj.bias": 0.0, "gain": 0.0}
    ref = {n: [p.detach().double().clone(), torch.zeros(p.shape, dtype=torch.float64),
               torch.zeros(p.shape, dtype=torch.float64), 0] for n, p in params.items()}
    g = torch.Generator().manual_seed(1)
    for step, lr in enumerate([1e-2, 3e-2, 2e-2, 5e-3, 1e-2]):
        for group in opt.param_groups:
            group["lr"] = lr
        for name, p in params.items():
            if step == 2 and name in ("embed", "gain"):
                p.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=g) + 0.3
            r = ref[name]
            r[3] += 1
            r[:3] = adamw_float64(r[0], r[1], r[2], r[3], p.grad.double(), lr, (0.7, 0.9), 1e-3, decays[name])
        opt.step()
    for name, p in params.items():
        torch.testing.assert_close(p.detach().double(), ref[name][0], rtol=1e-6, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------ LoRA against PEFT
def lora_policy(**lora):
    section = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny", "lora": lora}},
                       "data": {"path": "x"}})["model"]["policy"]
    return build_policy(section, Tokenizer.builtin(), seed=1)


@pytest.mark.parametrize("targets", [["k_proj", "gate_proj"], ["v_proj", "o_proj", "up_proj", "down_proj"]])
def test_adapter_gradients_and_merge_equal_peft(tmp_path, targets):
    """Adapters on some rows of the fused projections (k of qkv, gate of gate_up, ...), in float64: the gradient of
    every A and B equals PEFT's, and the merged model gives PEFT's merge_and_unload logits."""
    policy = lora_policy(rank=3, alpha=5, targets=targets).double()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for t, _, _ in peft_targets(policy).values():
            t.copy_(0.2 * torch.randn(t.shape, generator=g))
    twin = peft_twin(policy, tmp_path)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    got, want = policy(ids), twin(input_ids=ids).logits
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    ours = {k: t.grad for k, (t, _, _) in peft_targets(policy).items()}
    theirs = {n.replace(".default.", "."): p.grad for n, p in twin.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 2 * len(targets) * policy.config.num_hidden_layers
    for key, grad in ours.items():
        # the two models' bases agree to about 1e-7 (float32 rotary tables), which the gradients carry
        torch.testing.assert_close(grad, theirs[key], rtol=0, atol=1e-4 * float(theirs[key].abs().max()), msg=key)
    with torch.no_grad():
        merged = merged_copy(policy)(ids)
        assert (merged - twin.merge_and_unload()(input_ids=ids).logits).abs().max() < 1e-5
        assert (merged - got).abs().max() < 1e-5


def test_adapters_start_as_peft_initialises_them():
    """B zero, so the adapted model equals its base bit for bit; A Kaiming-uniform with a = sqrt(5) (PEFT's), whose
    bound is 1 / sqrt(in_features)."""
    policy = lora_policy(rank=8, alpha=16)
    ids = torch.randint(0, policy.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        adapted = policy(ids)
        with adapters_disabled(policy):
            assert torch.equal(adapted, policy(ids))
    for key, (t, _, _) in peft_targets(policy).items():
        if key.endswith("lora_B.weight"):
            assert not t.any(), key
        else:
            bound = 1 / math.sqrt(t.shape[1])
            assert 0.9 * bound < float(t.detach().abs().max()) <= bound, key
            assert abs(float(t.detach().mean())) < 0.1 * bound, key


def test_dropout_masks_are_drawn_again_alike_under_gradient_checkpointing():
    """A recomputed layer draws the adapters' dropout masks of its first forward: the gradients equal those of the
    run that keeps its activations."""
    ids = torch.randint(0, Tokenizer.builtin().vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    grads = []
    for recompute in (False, True):
        section = resolve({"recipe": "sft", "data": {"path": "x"}, "model": {"policy": {
            "preset": "tiny", "lora": {"rank": 4, "dropout": 0.3}, "gradient_checkpointing": recompute}}})
        policy = build_policy(section["model"]["policy"], Tokenizer.builtin(), seed=2).train()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for t, _, _ in peft_targets(policy).values():
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
        torch.manual_seed(7)
        policy(ids).logsumexp(-1).mean().backward()
        grads.append({k: t.grad for k, (t, _, _) in peft_targets(policy).items()})
    assert all(torch.equal(grads[0][k], grads[1][k]) and grads[0][k].abs().max() > 0 for k in grads[0])


def test_only_the_adapters_step_all_decayed():
    """Under LoRA the optimizer holds the adapters alone (no base weight, norm or embedding), all of them matrices
    in the decayed group."""
    policy = lora_policy(rank=2, alpha=4, targets=["q_proj", "down_proj"])
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": {"path": "x.jsonl"},
                   "optimizer": {"weight_decay": 0.1}})
    opt = build_optimizer(policy, cfg["optimizer"], cfg)
    (group,) = opt.param_groups
    assert group["weight_decay"] == 0.1
    assert {id(p) for p in group["params"]} == {id(t) for t, _, _ in peft_targets(policy).values()}


def test_a_target_that_is_not_a_projection_is_one_error():
    with pytest.raises(FwError) as e:
        lora_policy(targets=["q_proj", "lm_head"])
    assert str(e.value).count("\n") == 0 and "model.policy.lora.targets[1]" in str(e.value)
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(e.value)


def test_add_adapters_refuses_an_unknown_target_before_touching_the_model():
    """A section built by hand (a plugin, a script) skips the schema: the unknown name is one FwError naming it and
    PEFT's names, and the model is left trainable and without adapters."""
    from framework.models.lora import add_adapters, has_adapters

    section = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": {"path": "x"}})
    base = build_policy(section["model"]["policy"], Tokenizer.builtin(), seed=1)
    with pytest.raises(FwError) as e:
        add_adapters(base, {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q_proj", "qkv_proj"]})
    assert str(e.value) == ("add_adapters: 'qkv_proj' is not a LoRA target; the targets are PEFT's module names: "
                            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
    assert not has_adapters(base) and all(p.requires_grad for p in base.parameters())
