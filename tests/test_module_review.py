"""Adversarial review of recomputation, the value model and the module's optimizer steps: every
gradient_checkpointing mode against none in float64 (LoRA dropout masks, packed rows, no_grad scoring, the critic),
the critic against transformers' Qwen3Model with a linear head in float64, and the module's per-role clipping and
train/eval modes."""

from __future__ import annotations

import copy
import itertools
import math
import types

import pytest
import torch
import transformers

from framework.config import resolve
from framework.models import Qwen3ForCausalLM, Qwen3ValueModel
from framework.models.lora import add_adapters
from framework.models.qwen3 import Packing, SharedPrompts
from framework.models.qwen3_config import Qwen3Config
from framework.module import FwModule

HF = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "rope_theta": 5000.0,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 256}
MODES = [False, True, "selective"]
T = 14
DATA = "recipes/data/arithmetic_chat.jsonl"


def _random_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from their init (norms around one, adapters' B non-zero), so that every path carries gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def _policy(lora_dropout: float | None = None) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(HF)).double()
    if lora_dropout is not None:
        add_adapters(model, {"rank": 4, "alpha": 8, "dropout": lora_dropout,
                             "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"]})
    return _random_(model, 1).train()


def _critic() -> Qwen3ValueModel:
    return _random_(Qwen3ValueModel.from_policy(_policy()), 2).train()


def _rows():
    ids = torch.randint(0, HF["vocab_size"], (2, T), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(T).repeat(2, 1)
    positions[0, 5:] -= 5           # row 0 packs sequences of 5 and 9 tokens
    positions[1, 8:] -= 8           # row 1 of 8 and 6
    cu = torch.tensor([0, 5, 14, 22, 28], dtype=torch.int32)
    return ids, positions, Packing(cu, 9)


def _shared_prompts():
    """One row of two groups: prompts of 4 and 3 tokens, then the first group's completions of 3 and 2 tokens and
    the second's one of 4."""
    ids = torch.randint(0, HF["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 4, 5, 3, 4, 5, 6]])
    cu_prompts, cu_groups, cu_seqs = (torch.tensor(v, dtype=torch.int32) for v in ((0, 4, 7), (0, 5, 9),
                                                                                  (0, 4, 7, 10, 12, 16)))
    return ids, positions, SharedPrompts(7, cu_prompts, 4, cu_groups, 5, cu_seqs, 4)


def _out_and_grads(model: torch.nn.Module, mode, inputs: tuple, seed: int = 5):
    """Output and every trained parameter's gradient of one forward + backward, the dropout masks drawn from `seed`."""
    model.gradient_checkpointing = mode
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    ids, positions, packing = inputs
    out = model(ids, positions, packing=packing)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    (out.tanh() * weights).sum().backward()
    return out.detach(), [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("mode", MODES[1:], ids=["layers", "selective"])
@pytest.mark.parametrize("packing", ["rows", "position_ids", "cu_seqlens", "shared_prompts"])
@pytest.mark.parametrize("model", ["policy", "lora-dropout", "critic"])
def test_every_recompute_mode_gives_the_gradients_of_none_bit_for_bit(mode, packing, model):
    """float64: the forward and every gradient of a recomputed forward are those of keeping every activation, with
    LoRA's dropout masks drawn again identically in the recomputation (they would differ if it drew new ones: the
    dropout case fails when torch.utils.checkpoint is told not to preserve the RNG state)."""
    net = {"policy": lambda: _policy(), "lora-dropout": lambda: _policy(0.3), "critic": _critic}[model]()
    ids, positions, cu = _rows()
    inputs = {"rows": (ids, None, None), "position_ids": (ids, positions, None),
              "cu_seqlens": (ids, positions, cu), "shared_prompts": _shared_prompts()}[packing]
    out, grads = _out_and_grads(net, False, inputs)
    out2, grads2 = _out_and_grads(net, mode, inputs)
    assert torch.equal(out, out2)
    assert len(grads) == len(grads2) and all(g is not None for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
    if model == "lora-dropout":   # the masks matter: another draw changes the gradients
        _, other = _out_and_grads(net, mode, inputs, seed=6)
        assert not all(torch.equal(a, b) for a, b in zip(grads, other, strict=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", ["policy", "lora-dropout", "critic"])
def test_scoring_under_no_grad_is_the_grad_forward_and_keeps_no_graph(mode, model):
    """A training-mode model scored under torch.no_grad (old logprobs, old values) gives the values of the forward
    with gradients, with the same dropout masks, and leaves no recomputation state behind."""
    from framework.models import recompute

    net = {"policy": lambda: _policy(), "lora-dropout": lambda: _policy(0.3), "critic": _critic}[model]()
    net.gradient_checkpointing = mode
    ids, positions, cu = _rows()
    torch.manual_seed(7)
    with torch.no_grad():
        scored = net(ids, positions, packing=cu)
    assert not scored.requires_grad and recompute._ACTIVE.get() is None
    torch.manual_seed(7)
    assert torch.equal(scored, net(ids, positions, packing=cu).detach())


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture
def hf_float64(monkeypatch):
    """transformers' Qwen3 with its RMSNorm in float64: as shipped it normalises in float32 whatever the weights' dtype,
    which would bound the comparison at float32's rounding. Its rotary angles stay float32, as fw's are by design
    (ops_cuda.rope: position x inverse frequency in float32, as transformers computes them)."""
    from transformers.models.qwen3 import modeling_qwen3

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm_float64)


def _hf_trunk(critic: Qwen3ValueModel) -> transformers.Qwen3Model:
    hf = transformers.Qwen3Model(transformers.Qwen3Config(**HF, torch_dtype=torch.float64)).double().eval()
    sd = {k.removeprefix("model."): v.clone() for k, v in critic.hf_state_dict().items() if k.startswith("model.")}
    hf.load_state_dict(sd, strict=True)
    return hf


@pytest.mark.parametrize("mode", MODES)
def test_critic_values_and_gradients_are_transformers_trunk_and_a_linear_head(mode, hf_float64):
    """float64: V = h @ w + b over the last hidden states of transformers' Qwen3Model on the same weights, and the
    gradients of a loss of V with respect to the head and to every trunk weight are that computation's."""
    critic = _critic()
    critic.gradient_checkpointing = mode
    hf = _hf_trunk(critic)
    ids = torch.randint(0, HF["vocab_size"], (2, T), generator=torch.Generator().manual_seed(4))
    target = torch.randn(2, T, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    v = critic(ids)
    assert v.shape == (2, T) and v.dtype == torch.float64
    (v - target).square().mean().backward()

    w = critic.v_head.weight.detach().clone().requires_grad_()
    b = critic.v_head.bias.detach().clone().requires_grad_()
    ref = hf(input_ids=ids).last_hidden_state @ w[0] + b[0]
    (ref - target).square().mean().backward()
    torch.testing.assert_close(v, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(critic.v_head.weight.grad, w.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(critic.v_head.bias.grad, b.grad, rtol=1e-10, atol=1e-12)
    hf_grads = dict(hf.named_parameters())
    # our fused weights' gradients, cut into HF's tensors the same way as the weights
    for name, (param, lo, hi) in critic.hf_targets().items():
        if not name.startswith("model."):
            continue
        ours = param.grad if lo is None else param.grad[lo:hi]
        torch.testing.assert_close(ours, hf_grads[name.removeprefix("model.")].grad, rtol=1e-9, atol=1e-12,
                                   msg=name)


def test_critic_on_packed_rows_is_each_sequence_alone(hf_float64):
    """Packed rows (cu_seqlens) give every sequence the values it has alone in transformers' trunk."""
    critic = _critic()
    hf = _hf_trunk(critic)
    ids, positions, packing = _rows()
    v = critic(ids, positions, packing=packing).detach()
    flat_ids, flat_v = ids.reshape(-1), v.reshape(-1)
    cu = packing.cu_seqlens.tolist()
    for lo, hi in itertools.pairwise(cu):
        with torch.no_grad():
            ref = hf(input_ids=flat_ids[None, lo:hi]).last_hidden_state[0] @ critic.v_head.weight[0]
        torch.testing.assert_close(flat_v[lo:hi], ref + critic.v_head.bias[0], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the module: per-role clipping and modes
def _ppo_module(tmp_path, policy_max: float | None, critic_max: float | None) -> FwModule:
    cfg = resolve({"recipe": "ppo", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "digits", "init_args": {"num_digits": 1}}, "chat_template": False},
                   "optimizer": {"max_grad_norm": policy_max}, "ppo": {"critic": {"max_grad_norm": critic_max}},
                   "trainer": {"accelerator": "cpu", "max_steps": 2}})
    torch.manual_seed(0)
    module = FwModule(cfg)
    module.configure_optimizers()
    # what the module reads of a trainer while it clips: the strategy's model (not FSDP), the callbacks, the world
    module._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(model=module), callbacks=[], world_size=1)
    g = torch.Generator().manual_seed(1)
    for model, scale in ((module.policy, 1.0), (module.value, 3.0)):
        for p in model.parameters():
            p.grad = scale * torch.randn(p.shape, generator=g, dtype=p.dtype)
    return module


def _norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))


@pytest.mark.parametrize("policy_max,critic_max", [(0.1, None), (None, 0.5), (0.1, 0.5), (None, None)])
def test_policy_and_critic_clip_to_their_own_max_grad_norm(tmp_path, policy_max, critic_max):
    """optimizer.max_grad_norm clips the policy and ppo.critic.max_grad_norm the critic, each over its own
    gradients only; null measures without clipping. Each role's norm before the clip is logged under its name."""
    module = _ppo_module(tmp_path, policy_max, critic_max)
    before = {"policy": _norm(module.policy), "critic": _norm(module.value)}
    grads = {p: p.grad.clone() for p in module.parameters() if p.grad is not None}
    for role, model, limit in (("policy", module.policy, policy_max), ("critic", module.value, critic_max)):
        module._before_step(module._optimizer_of[role])
        assert float(module.grad_norms[role]) == pytest.approx(before[role], rel=1e-6)
        factor = 1.0 if limit is None else min(1.0, limit / (before[role] + 1e-6))   # clip_grad_norm_'s eps
        assert factor < 1.0 or limit is None   # the limits are below both norms: the clip acts when set
        for p in model.parameters():
            torch.testing.assert_close(p.grad, grads[p] * factor, rtol=1e-6, atol=0)
    assert _norm(module.value) == pytest.approx(before["critic"] if critic_max is None else critic_max, rel=1e-5)
    metrics = module.step_metrics.compute()
    assert metrics["grad_norm"] == pytest.approx(before["policy"], rel=1e-6)
    assert metrics["critic_grad_norm"] == pytest.approx(before["critic"], rel=1e-6)


def test_train_and_eval_reach_every_model_but_the_frozen_reference(tmp_path):
    """module.train() puts the policy and critic in training mode and keeps the reference in eval mode (a dropout
    in it would make the KL noisy); module.eval() puts all of them in eval mode."""
    module = _ppo_module(tmp_path, 1.0, 1.0)
    ref = copy.deepcopy(module.policy).eval()
    module.reference = ref
    for mode in (True, False, True):
        module.train(mode)
        assert all(m.training is mode for m in module.policy.modules())
        assert all(m.training is mode for m in module.value.modules())
        assert not any(m.training for m in ref.modules())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_module_with_a_critic_round_trips_through_its_checkpoint(tmp_path, lora):
    """PPO's module (policy, or its adapters over a base rebuilt from the seed, and the critic with its head) saved
    and loaded into a module built from the same seed and trained otherwise: every tensor of the state dict comes
    back bit for bit (the reference, never saved, is rebuilt from the seed as the run built it)."""
    over = {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}} if lora else {}
    cfg = resolve({"recipe": "ppo", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny", **over}},
                   "data": {"task": {"name": "digits", "init_args": {"num_digits": 1}}, "chat_template": False},
                   "trainer": {"accelerator": "cpu", "max_steps": 2}})
    modules = []
    for seed in (1, 2):
        torch.manual_seed(0)
        modules.append(FwModule(cfg))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():   # trained-looking weights: adapters, critic and head away from their init
            for p in modules[-1].parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
    a, b = modules
    assert not torch.equal(a.value.v_head.weight, b.value.v_head.weight)
    checkpoint = {"state_dict": a.state_dict()}
    a.on_save_checkpoint(checkpoint)
    assert not any(k.startswith(("policy.", "value.")) for k in checkpoint["state_dict"])
    b.on_load_checkpoint(checkpoint)
    b.load_state_dict(checkpoint["state_dict"])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and any(k.startswith("value.v_head") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_a_critic_step_clips_steps_and_zeroes_only_the_critic(tmp_path):
    """ctx.step("critic"): AdamW on the critic's gradients clipped to ppo.critic.max_grad_norm (a float64 AdamW step
    by hand on them), then its gradients zeroed; the policy's weights, gradients, version and LR schedule stay."""
    module = _ppo_module(tmp_path, 0.1, 0.5)
    critic_opt = module._optimizer_of["critic"]
    policy_before = {p: (p.detach().clone(), p.grad.clone()) for p in module.policy.parameters()}
    factor = 0.5 / (_norm(module.value) + 1e-6)
    expected = {}
    for group in critic_opt.param_groups:
        (beta1, beta2), eps, lr, wd = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        for p in group["params"]:
            g = p.grad.double() * factor
            m, v = (1 - beta1) * g, (1 - beta2) * g * g
            w = p.detach().double() * (1 - lr * wd)
            expected[p] = w - lr * (m / (1 - beta1)) / ((v / (1 - beta2)).sqrt() + eps)
    module.step_optimizer("critic")
    assert len(expected) == len(list(module.value.parameters()))
    for p, want in expected.items():
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-6, atol=1e-7)
        assert p.grad is None
    for p, (w, g) in policy_before.items():
        assert torch.equal(p, w) and torch.equal(p.grad, g)
    assert module.policy_version == 0


def test_critic_on_shared_prompts_is_each_sequence_whole(hf_float64):
    """Groups sharing a prompt (SharedPrompts): each completion token's value, and each prompt token's, is the one
    transformers' trunk and the head give the sequence laid out whole."""
    critic = _critic()
    hf = _hf_trunk(critic)
    ids, positions, packing = _shared_prompts()
    v = critic(ids, positions, packing=packing).detach()[0]
    ids = ids[0]
    # (prompt token range, completion token range) in the row, for each sequence
    for (p0, p1), (c0, c1) in (((0, 4), (7, 10)), ((0, 4), (10, 12)), ((4, 7), (12, 16))):
        whole = torch.cat([ids[p0:p1], ids[c0:c1]])
        with torch.no_grad():
            ref = hf(input_ids=whole[None]).last_hidden_state[0] @ critic.v_head.weight[0] + critic.v_head.bias[0]
        torch.testing.assert_close(torch.cat([v[p0:p1], v[c0:c1]]), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_gradients_are_measured_and_clipped_at_full_precision(tmp_path, dtype):
    """16-bit trained weights: the gradients' norm is the float64 one to float32's precision (in their own dtype it
    had three digits, and in float16 a finite norm over 65504 came out infinite, zeroing every gradient in the clip
    and reading as a divergence), and the clipped gradients have norm max_grad_norm up to their own rounding."""
    if dtype == "bfloat16":
        pytest.importorskip("torchao")   # bfloat16 weights train with stochastic rounding
    cfg = resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"), "data": {"path": DATA},
                   "model": {"policy": {"preset": "tiny", "dtype": dtype}},
                   "optimizer": {"max_grad_norm": 1.0, "stochastic_rounding": dtype == "bfloat16"},
                   "trainer": {"accelerator": "cpu", "max_steps": 2}})
    module = FwModule(cfg)
    module.configure_optimizers()
    module._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(model=module), callbacks=[], world_size=1)
    g = torch.Generator().manual_seed(0)
    for p in module.policy.parameters():   # every gradient finite in float16, their norm about 85,000
        p.grad = (200 * torch.randn(p.shape, generator=g)).to(p.dtype)
    expected = _norm(module.policy)
    assert 65504 < expected < 1e5
    module._before_step(module._optimizer_of["policy"])
    assert float(module.grad_norms["policy"]) == pytest.approx(expected, rel=1e-5)
    assert module.step_metrics.compute()["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert _norm(module.policy) == pytest.approx(1.0, rel=1e-3)
    assert module.grad_norms["policy"].dtype == torch.float32
