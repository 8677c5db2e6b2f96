"""The lean optimizers (torchao): each update against a float64 torch AdamW reference, stochastic
rounding's mean against the exact update, the bytes of each optimizer's state, exact resume through
`fit` and a checkpoint, a bf16 SFT run that learns, and the settings that cannot run.

torchao compiles its step per parameter shape and dtype on first use (tens of seconds on a cold
inductor cache, seconds on a warm one). The tests share shapes with the tiny preset (weights of
512 x 64, gains of 64) and run in one process, so each compiled step is built once for the module."""

import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework.callbacks import Callback
from framework.checkpoint import AtomicCheckpointIO, read_checkpoint_dir
from framework.config import resolve
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.optim import build_optimizer, optimizer_problems
from framework.schedule import LRSchedule
from framework.trainer import fit

pytest.importorskip("torchao")
from torchao.optim.subclass_8bit import OptimState8bit

ROOT = Path(__file__).resolve().parents[1]
BF16 = {"model": {"policy": {"preset": "tiny", "dtype": "bfloat16"}}, "trainer": {"precision": "bf16-true"}}


def cfg_with(optimizer=None, **sections):
    cfg = {"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": {"path": "x.jsonl"}}
    for name, values in sections.items():
        cfg[name] = values
    cfg["optimizer"] = {"lr": 1e-3, "weight_decay": 0.01, **(optimizer or {})}
    return resolve(cfg)


class Pair(torch.nn.Module):
    """A weight of a tiny-preset shape (its 8-bit moments are quantized: >= 4096 values in blocks of 256)
    and a norm gain (kept in full precision, and not decayed)."""

    def __init__(self, dtype=torch.float32, low=-1.0, high=1.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter((torch.rand(512, 64, generator=g) * (high - low) + low).to(dtype))
        self.gain = torch.nn.Parameter((torch.rand(64, generator=g) * (high - low) + low).to(dtype))


def state_bytes(value) -> int:
    """Bytes held by the tensors of an optimizer state entry, counting a tensor subclass's inner tensors."""
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, torch.Tensor):
        if hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(state_bytes(getattr(value, n)) for n in names)
        return value.numel() * value.element_size()
    return 0


# ------------------------------------------------------------------------------------ the update
def test_adamw8bit_follows_float64_adamw_under_the_lr_schedule():
    """Five steps of a warmup + cosine schedule: the gain (full-precision state) matches float64 AdamW to
    float32 rounding, the weight (8-bit moments) within the moments' quantisation error (relative to its
    whole displacement), and the optimizer's tensor lr follows the schedule."""
    cfg = cfg_with({"name": "adamw8bit", "lr": 1e-2})
    model = Pair()
    ref = Pair().double()
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    ref_opt = torch.optim.AdamW([{"params": [ref.weight], "weight_decay": 0.01},
                                 {"params": [ref.gain], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    schedule = LRSchedule("cosine", 2, 5, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: schedule(s))
    start = {n: p.detach().double().clone() for n, p in ref.named_parameters()}
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * schedule(step), rel=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            grad = torch.randn(p.shape, generator=g) + 0.5   # a drift, so the moments do not average out
            p.grad, q.grad = grad.clone(), grad.double()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)   # torchao reads the tensor the schedule fills
    assert isinstance(opt.state[model.weight]["exp_avg"], OptimState8bit)
    assert not isinstance(opt.state[model.gain]["exp_avg"], OptimState8bit)
    moved = {n: (ref_p.detach() - start[n]) for n, ref_p in ref.named_parameters()}
    # float32 arithmetic on values below 1: within about two ulps (2^-24 each) per step
    assert float((model.gain.detach().double() - ref.gain.detach()).abs().max()) < 5 * 2 * 2**-24
    error = float((model.weight.detach().double() - start["weight"] - moved["weight"]).norm() / moved["weight"].norm())
    # the 8-bit moments' rounding shows (float32 moments, as the gain's, stay near 1e-5), by a few percent
    assert 1e-4 < error < 0.03, error


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_stochastic_rounding_is_unbiased_where_nearest_rounding_does_not_move(name):
    """An update of about 1/8 of bfloat16's resolution on weights in [1, 2): nearest rounding leaves every
    weight where it was; stochastic rounding lands, on average over the 32768 weights, on the float64
    AdamW update (each rounding error is at most one ulp, 2^-7, so the mean's standard deviation is at
    most 2^-8 / sqrt(32768))."""
    def one_step(stochastic):
        cfg = cfg_with({"name": name, "stochastic_rounding": stochastic}, **BF16)
        model = Pair(torch.bfloat16, 1.0, 2.0)
        opt = build_optimizer(model, cfg["optimizer"], cfg)
        grad = torch.rand(model.weight.shape, generator=torch.Generator().manual_seed(2)) + 0.1
        model.weight.grad = grad.bfloat16()
        opt.step()
        return model.weight.detach()

    start = Pair(torch.bfloat16, 1.0, 2.0).weight.detach()
    ref = torch.nn.Parameter(start.double())
    ref.grad = (torch.rand(ref.shape, generator=torch.Generator().manual_seed(2)) + 0.1).bfloat16().double()
    torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01).step()
    exact = ref.detach()
    assert float((exact - start.double()).mean()) == pytest.approx(-1e-3, rel=0.05)

    if name == "adamw":
        assert torch.equal(one_step(False), start)   # torch AdamW on bf16 weights: nothing moves
    rounded = one_step(True)
    bias = float((rounded.double() - exact).mean())
    assert abs(bias) < 5 * 2**-8 / math.sqrt(exact.numel()), bias
    assert float((rounded.double() - exact).abs().max()) <= 2**-7   # up or down to a neighbour only


@pytest.mark.parametrize("name, stochastic, dtype, per_value", [
    ("adamw", False, torch.float32, 8), ("adamw", True, torch.bfloat16, 4), ("adamw", False, torch.float16, 12),
    ("adamw8bit", False, torch.float32, 2), ("adamw8bit", True, torch.bfloat16, 2)])
def test_state_bytes_per_parameter(name, stochastic, dtype, per_value):
    """Two moments of 4 (float32) / 2 (bfloat16) bytes a value, float16 weights' float32 moments and master copy;
    8-bit moments take 1 byte a value plus one float32 scale per block of 256 and a 256-entry float32 code map
    each. Small tensors keep full ones."""
    extra = dict(BF16) if dtype == torch.bfloat16 else {"trainer": {"precision": "16-true"}} \
        if dtype == torch.float16 else {}
    cfg = cfg_with({"name": name, "stochastic_rounding": stochastic}, **extra)
    model = Pair(dtype)
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    n = model.weight.numel()
    moments = state_bytes({k: v for k, v in opt.state[model.weight].items() if k != "step"})
    if name == "adamw8bit":
        assert moments == 2 * (n + n // 256 * 4 + 256 * 4)
        assert state_bytes({k: v for k, v in opt.state[model.gain].items() if k != "step"}) == 2 * 64 * dtype.itemsize
    else:
        assert moments == per_value * n


def adamw_float64(p, m, v, g, t, lr, betas, eps, weight_decay):
    """One AdamW step in float64, by its definition: decoupled decay, bias-corrected moments."""
    b1, b2 = betas
    p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return p, m, v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_float16_weights_follow_float64_adamw_from_small_gradients(device):
    """trainer.precision: 16-true, torch's AdamW (fused, as auto picks for float16): 5 steps on gradients of 1e-4 to
    1e-3 with random signs. In float16 the second moment, 1e-3 g^2 at the first step, would be 0 (below 2^-25), and
    the update lr * g / eps; the float32 moments and master copy follow float64 AdamW instead. The master copy is
    within float32 rounding of the reference, so the float16 weight is the reference rounded to float16, or where
    the reference lies within that rounding of a midpoint between two float16 values, its neighbour: one float16
    step at most, and nearly everywhere none."""
    cfg = cfg_with({"lr": 1e-3, "weight_decay": 0.1}, trainer={"precision": "16-true"})
    model = Pair(torch.float32, 0.5, 1.5).half().to(device)   # gains near 1, where a float16 step is 2^-10
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    assert opt.defaults["fused"] is True
    assert torch.tensor(1e-3 * 1e-3**2, dtype=torch.float16).item() == 0.0
    g = torch.Generator().manual_seed(1)
    params = [model.weight, model.gain]
    ref = {p: [p.detach().double().cpu(), torch.zeros(p.shape, dtype=torch.float64),
               torch.zeros(p.shape, dtype=torch.float64)] for p in params}
    for t in range(1, 6):
        for p in params:
            size = torch.rand(p.shape, generator=g) * 9e-4 + 1e-4
            sign = torch.randint(0, 2, p.shape, generator=g) * 2 - 1
            p.grad = (size * sign).half().to(device)
            decay = 0.1 if p.ndim == 2 else 0.0   # param_groups: no decay on 1-D parameters
            ref[p] = list(adamw_float64(*ref[p], p.grad.double().cpu(), t, 1e-3, (0.9, 0.999), 1e-8, decay))
        opt.step()
    for p in params:
        exact, m, v = ref[p]
        state = opt.state[p]
        assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "master")} == {torch.float32}
        # torch's CUDA kernel rounds beta2 to float32 before taking 1 - beta2: 0.00099998713, 1.29e-5 under 1e-3
        torch.testing.assert_close(state["exp_avg_sq"].double().cpu(), v, rtol=2e-5, atol=0)
        torch.testing.assert_close(state["exp_avg"].double().cpu(), m, rtol=1e-5, atol=1e-9)   # sums of terms <= 1e-3
        torch.testing.assert_close(state["master"].double().cpu(), exact, rtol=2**-20, atol=0)   # 16 float32 roundings
        rounded = exact.half().double()
        step = 2.0 ** (torch.floor(torch.log2(rounded.abs())) - 10)   # a float16 step there (all normal values)
        off = (p.detach().double().cpu() - rounded).abs() / step
        assert off.max() <= 1, off.max()
        assert (off == 0).double().mean() >= 0.99
    start = Pair(torch.float32, 0.5, 1.5).gain.half()
    assert (model.gain.detach().cpu() != start).double().mean() > 0.5   # the gains moved by float16 steps


def test_float16_state_loads_as_saved():
    """A state dict of float16 weights' AdamW through torch.save: torch's Optimizer.load_state_dict casts every state
    tensor to its parameter's dtype, which would round the float32 moments and master copy to float16. They load
    as saved, and the next steps equal the uninterrupted run's bit for bit."""
    cfg = cfg_with({"lr": 1e-3}, trainer={"precision": "16-true"})

    def run(model, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=g) * 1e-3).half()
            opt.step()

    straight, resumed = Pair().half(), Pair().half()
    opt = build_optimizer(straight, cfg["optimizer"], cfg)
    run(straight, opt, 2, 0)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    with torch.no_grad():
        for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
            a.copy_(b)
    reopened = build_optimizer(resumed, cfg["optimizer"], cfg)
    reopened.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert same_state(reopened.state_dict(), opt.state_dict())
    run(straight, opt, 2, 1)
    run(resumed, reopened, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters(), strict=True))
    assert same_state(reopened.state_dict(), opt.state_dict())


# ---------------------------------------------------------------------------------- fit and resume


class LoadedState(Callback):
    """Keeps the policy optimizer's state as it is when training (re)starts, after any checkpoint load."""

    def on_train_start(self, trainer, module):
        buffer = io.BytesIO()   # a copy: the live state changes with every later step
        torch.save(trainer.optimizers[0].state_dict(), buffer)
        self.state = buffer.getvalue()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    lines = (ROOT / "recipes/data/arithmetic_chat.jsonl").read_text().splitlines()[:40]
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def sft(run_dir, data, optimizer, steps, callbacks=(), bf16=True, **trainer):
    return resolve({
        "recipe": "sft", "seed": 5, "run_dir": str(run_dir),
        "model": {"policy": {"preset": "tiny", "dtype": "bfloat16" if bf16 else None}},
        "data": {"path": data, "max_seq_len": 96, "batch_size": 2},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 0.5, **optimizer},
        "scheduler": {"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
        "trainer": {"accelerator": "cpu", "max_steps": steps, "accumulate_grad_batches": 2,
                    "precision": "bf16-true" if bf16 else "32-true", "enable_progress_bar": False, **trainer},
        "checkpoint": {"every_n_steps": 3, "keep_last": None},
        "logging": {"csv": False, "tensorboard": False},
        "callbacks": list(callbacks)})


def same_state(a, b) -> bool:
    """Bitwise equality of two optimizer state dicts, 8-bit states compared by codes, scales and map."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, OptimState8bit):
        return (type(b) is OptimState8bit and a.signed == b.signed
                and all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("codes", "scale", "qmap")))
    if isinstance(a, torch.Tensor):
        return type(b) is type(a) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("optimizer, precision", [
    pytest.param({"name": "adamw8bit"}, "32-true", marks=pytest.mark.slow, id="adamw8bit"),
    pytest.param({"stochastic_rounding": True}, "bf16-true", id="adamw-sr"),
    pytest.param({"name": "adamw8bit", "stochastic_rounding": True}, "bf16-true", id="adamw8bit-sr"),
    pytest.param({}, "16-true", id="adamw-16-true")])
def test_resumed_run_equals_uninterrupted(tmp_path, chats, optimizer, precision):
    """6 steps straight vs 3 steps (a crash after step 4) + resume from step 3: the same final weights
    and metrics, and the optimizer state loaded at the resume is the one saved, 8-bit codes and float16 weights'
    float32 moments and master copies included."""
    bf16 = precision == "bf16-true"
    fit(sft(tmp_path / "straight", chats, optimizer, 6, bf16=bf16, precision=precision))
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 4}}
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(sft(tmp_path / "broken", chats, optimizer, 6, [crash], bf16=bf16, precision=precision))
    probe = {"class_path": "test_optim.LoadedState"}
    trainer = fit(sft(tmp_path / "broken", chats, optimizer, 6, [probe], bf16=bf16, precision=precision),
                  resume="last")
    assert trainer.global_step == 6

    saved = read_checkpoint_dir(tmp_path / "broken/checkpoints/step-000003")   # weights_only, as a resume
    loaded = torch.load(io.BytesIO(next(cb for cb in trainer.callbacks if isinstance(cb, LoadedState)).state))
    assert same_state(saved["optimizer_states"][0], loaded)
    kinds = {type(s["exp_avg"]).__name__ for s in loaded["state"].values()}
    assert kinds == ({"OptimState8bit", "Tensor"} if "name" in optimizer else {"Tensor"})
    if precision == "16-true":
        assert {s[k].dtype for s in loaded["state"].values() for k in ("exp_avg", "exp_avg_sq", "master")} == {
            torch.float32}
    if "name" in optimizer:
        # `fw fit --resume` in a fresh process loads the checkpoint before torchao is imported: the loader
        # itself allows the 8-bit state class for the weights-only torch.load.
        cfg = sft(tmp_path / "broken", chats, optimizer, 6, bf16=bf16)
        allowed = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        try:
            step3 = tmp_path / "broken/checkpoints/step-000003"
            with pytest.raises(FwError, match="OptimState8bit tensor, a class not allowed"):
                read_checkpoint_dir(step3)
            reloaded = AtomicCheckpointIO(cfg).load_checkpoint(step3)
            assert same_state(reloaded["optimizer_states"][0], saved["optimizer_states"][0])
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(allowed)

    def final(run):
        return load_file(str(tmp_path / run / "checkpoints/step-000006/policy/model.safetensors"))

    a, b = final("straight"), final("broken")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timing = {"tokens_per_s"}
    metrics = [[{k: v for k, v in r.items() if k not in timing} for r in read_metrics(tmp_path / run / "metrics.jsonl")]
               for run in ("straight", "broken")]
    assert metrics[0] == metrics[1] and [r["step"] for r in metrics[0]] == list(range(1, 7))


def test_bf16_sft_with_8bit_moments_and_stochastic_rounding_learns(tmp_path, chats):
    """bf16 weights, bf16-true, adamw8bit + stochastic rounding: the loss falls as it does under float32
    AdamW with the same data and schedule."""
    lean = {"name": "adamw8bit", "stochastic_rounding": True}
    fit(sft(tmp_path / "lean", chats, lean, 12, log_every_n_steps=3))
    fit(sft(tmp_path / "fp32", chats, {}, 12, bf16=False, log_every_n_steps=3))
    lean_loss = [r["loss"] for r in read_metrics(tmp_path / "lean/metrics.jsonl")]
    fp32_loss = [r["loss"] for r in read_metrics(tmp_path / "fp32/metrics.jsonl")]
    assert lean_loss[-1] < 0.8 * lean_loss[0], lean_loss
    assert abs(lean_loss[-1] - fp32_loss[-1]) < 0.1 * fp32_loss[-1], (lean_loss, fp32_loss)


def test_manual_optimization_under_bf16_true_keeps_float32_step_counts_and_scales(tmp_path):
    """GRPO steps inside training_step, where bf16-true precision makes bfloat16 torch's default dtype: the states
    the first step creates (step counters, 8-bit block scales) are float32 all the same. A bfloat16 counter stops
    at 256 and misplaces every later bias correction."""
    run = tmp_path / "grpo"
    fit(resolve({"recipe": "grpo", "seed": 5, "run_dir": str(run),
                 "model": {"policy": {"preset": "tiny", "dtype": "bfloat16"}},
                 "data": {"task": {"name": "digits"}}, "reward": {"name": "numeric_match"},
                 "rollout": {"prompts_per_step": 2, "max_new_tokens": 2}, "grpo": {"group_size": 2},
                 "optimizer": {"name": "adamw8bit", "stochastic_rounding": True, "lr": 1e-3},
                 "trainer": {"accelerator": "cpu", "max_steps": 2, "precision": "bf16-true",
                             "enable_progress_bar": False},
                 "checkpoint": {"every_n_steps": 2}, "logging": {"csv": False, "tensorboard": False}}))
    states = read_checkpoint_dir(run / "checkpoints/step-000002")["optimizer_states"][0]["state"].values()
    assert {s["step"].dtype for s in states} == {torch.float32} and {float(s["step"]) for s in states} == {2.0}
    scales = {s[k].scale.dtype for s in states for k in ("exp_avg", "exp_avg_sq") if isinstance(s[k], OptimState8bit)}
    assert scales == {torch.float32}


def test_ppo_critic_gets_the_same_kind_of_optimizer():
    from framework.module import FwModule

    cfg = resolve({"recipe": "ppo", "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "digits"}}, "reward": {"name": "numeric_match"},
                   "optimizer": {"name": "adamw8bit", "lr": 2e-3, "weight_decay": 0.1},
                   "ppo": {"critic": {"lr": 5e-3, "weight_decay": 0.0}}})
    module = FwModule(cfg)
    (policy_opt, critic_opt), _ = module.configure_optimizers()
    for opt, model, lr, decay in ((policy_opt, module.policy, 2e-3, 0.1), (critic_opt, module.value, 5e-3, 0.0)):
        assert type(opt).__name__ == "AdamW8bit"
        held = [p for g in opt.param_groups for p in g["params"]]
        assert {id(p) for p in held} == {id(p) for p in model.parameters() if p.requires_grad}
        assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([lr] * len(opt.param_groups))
        assert [g["weight_decay"] for g in opt.param_groups] == [decay, 0.0]
        assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"])
        assert all(p.ndim < 2 for p in opt.param_groups[1]["params"])


# ------------------------------------------------------------------------- settings that cannot run
@pytest.mark.parametrize("optimizer, sections, key, says", [
    ({"stochastic_rounding": True}, {}, "optimizer.stochastic_rounding: true", "but they are float32"),
    ({"stochastic_rounding": True}, {"model": {"policy": {"preset": "tiny", "dtype": "bfloat16"}},
                                     "trainer": {"precision": "16-true"}}, "optimizer.stochastic_rounding: true",
     "but they are float16"),
    ({"name": "adamw8bit", "fused": True}, {}, "optimizer.fused: true", "fw's own kernel"),
    ({"cpu_offload": True}, {"trainer": {"accelerator": "cpu"}}, "optimizer.cpu_offload: true", "no CUDA GPU"),
    ({"cpu_offload": True}, {"trainer": {"accelerator": "cpu", "precision": "16-mixed"}},
     "optimizer.cpu_offload: true", "trainer.precision: 16-mixed"),
])
def test_problems_name_the_key(optimizer, sections, key, says):
    problems = optimizer_problems(cfg_with(optimizer, **sections))
    assert any(p.startswith(key) and says in p for p in problems), problems


@pytest.mark.parametrize("optimizer, names", [
    ({"name": "adamw8bit"}, ["optimizer.name: adamw8bit"]),
    ({"stochastic_rounding": True}, ["optimizer.stochastic_rounding: true"]),
    ({"name": "adamw8bit", "stochastic_rounding": True},
     ["optimizer.name: adamw8bit", "optimizer.stochastic_rounding: true"])])
def test_fused_refusal_names_only_the_settings_the_config_has(optimizer, names):
    """fused: true with torchao's step is refused naming the setting that selects that step, and not the other one,
    which the config may leave at its default."""
    cfg = cfg_with({**optimizer, "fused": True}, trainer={"precision": "bf16-true"})
    (problem,) = [p for p in optimizer_problems(cfg) if p.startswith("optimizer.fused: true")]
    named = [n for n in ("optimizer.name: adamw8bit", "optimizer.stochastic_rounding: true") if n in problem]
    assert named == names, problem


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
@pytest.mark.parametrize("sections, key", [
    ({"model": {"policy": {"preset": "tiny", "dtype": "bfloat16"}}, "trainer": {"precision": "bf16-mixed"}},
     "model.policy.dtype: bfloat16"),
    ({"trainer": {"precision": "bf16-true"}}, "trainer.precision: bf16-true"),
    ({"model": {"policy": {"preset": "tiny", "lora": {}}}, "trainer": {"precision": "bf16-true"}},
     "trainer.precision: bf16-true")])
def test_bfloat16_trained_weights_need_stochastic_rounding(sections, key, name):
    """Weights trained in bfloat16 (the policy's, or under bf16-true LoRA's adapters and PPO's critic too) lose most
    AdamW updates to nearest rounding (see test_stochastic_rounding_is_unbiased_where_nearest_rounding_does_not_move):
    refused at the key that makes them bfloat16, naming stochastic rounding, with which the settings run."""
    cfg = cfg_with({"name": name}, **sections)
    (problem,) = optimizer_problems(cfg)
    assert problem.startswith(f"{key} makes the trained weights bfloat16") and \
        "set optimizer.stochastic_rounding: true" in problem, problem
    cfg["optimizer"]["stochastic_rounding"] = True
    assert optimizer_problems(cfg) == []


def test_stochastic_rounding_under_lora_is_refused_unless_bf16_true_converts_the_adapters():
    """LoRA on a bfloat16 base under bf16-mixed trains float32 adapters (and a float32 critic), which stochastic
    rounding would not touch: refused; bf16-true converts them to bfloat16, where it applies."""
    from framework.models import build_policy
    from framework.tokenizer import Tokenizer

    lora = {"model": {"policy": {"preset": "tiny", "dtype": "bfloat16", "lora": {}}}}
    cfg = cfg_with({"stochastic_rounding": True}, **lora, trainer={"precision": "bf16-mixed"})
    trained = {p.dtype for p in build_policy(cfg["model"]["policy"], Tokenizer.builtin(), seed=0).parameters()
               if p.requires_grad}
    assert trained == {torch.float32}
    (problem,) = optimizer_problems(cfg)
    assert problem.startswith("optimizer.stochastic_rounding: true rounds bfloat16 weights, but the trained weights")
    assert "float32" in problem and "trainer.precision: bf16-true" in problem
    assert optimizer_problems(cfg_with({"stochastic_rounding": True}, **lora, trainer={"precision": "bf16-true"})) == []


@pytest.mark.parametrize("sections", [{"trainer": {"precision": "16-true"}},
                                      {"model": {"policy": {"preset": "tiny", "dtype": "float16"}}},
                                      {"model": {"policy": {"preset": "tiny", "lora": {}}},
                                       "trainer": {"precision": "16-true"}}])
def test_float16_trained_weights_step_unfused_in_float32(sections):
    """torch's own unfused AdamW computes in the weights' dtype, where eps 1e-8 is 0: a float16 weight whose gradient
    is 0 turns NaN on the first step. fw steps float16 weights through Float32StateAdamW, whose unfused step computes
    on float32 master copies, so fused: false is allowed: the first step against AdamW's arithmetic by hand (decay
    w (1 - lr wd), then lr g / (|g| + eps), since m and v are g and g^2 once bias-corrected)."""
    from framework.optim import Float32StateAdamW

    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    grad = torch.tensor([1.0, 0.0], dtype=torch.float16)
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    p.grad = grad.clone()
    torch.optim.AdamW([p], lr=1e-3, fused=False).step()
    assert torch.isnan(p[1])   # what torch's unfused step does
    assert optimizer_problems(cfg_with({"fused": False}, **sections)) == []
    q = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    q.grad = grad.clone()
    opt = Float32StateAdamW([q], lr=1e-3, weight_decay=0.01, fused=False)
    opt.step()
    g = grad.double()
    expected = (1 - 1e-3 * 0.01) - 1e-3 * g / (g.abs() + 1e-8)
    master = opt.state[q]["master"]
    assert master.dtype == torch.float32 and torch.allclose(master.double(), expected, rtol=0, atol=1e-7)
    assert torch.equal(q.detach(), master.half())
    assert optimizer_problems(cfg_with({"fused": "auto"}, **sections)) == []
    assert optimizer_problems(cfg_with({"fused": True}, **sections)) == []
    if "model" in sections and sections["model"]["policy"].get("dtype") == "float16":
        mixed = cfg_with({}, **sections, trainer={"precision": "16-mixed"})
        (problem,) = optimizer_problems(mixed)
        assert problem.startswith("model.policy.dtype: float16 makes the trained weights float16"), problem


@pytest.mark.parametrize("sections, key", [
    ({"trainer": {"precision": "16-true"}}, "trainer.precision: 16-true"),
    ({"model": {"policy": {"preset": "tiny", "dtype": "float16"}}}, "model.policy.dtype: float16"),
    ({"model": {"policy": {"preset": "tiny", "lora": {}}}, "trainer": {"precision": "16-true"}},
     "trainer.precision: 16-true")])
def test_adamw8bit_refuses_float16_trained_weights(sections, key):
    """torchao's 8-bit AdamW writes each update into the float16 weight itself: at lr 1e-4 Adam moves a weight of 1
    by about 1e-4 a step, under half a float16 step there (2^-11), so nearest rounding keeps it at 1 for ever.
    Refused at optimizer.name, naming the key that makes the weights float16 and the settings that keep the updates."""
    one = torch.tensor(1.0, dtype=torch.float16)
    assert one - 1e-4 == one and one + 1e-4 == one
    cfg = cfg_with({"name": "adamw8bit"}, **sections)
    (problem,) = optimizer_problems(cfg)
    assert problem.startswith("optimizer.name: adamw8bit keeps no float32 master copy") and key in problem, problem
    assert "optimizer.name: adamw" in problem and "optimizer.stochastic_rounding: true" in problem
    assert optimizer_problems(cfg_with({"name": "adamw"}, **sections)) == []


@pytest.mark.parametrize("optimizer, sections", [
    ({}, {}), ({"name": "adamw8bit"}, {}), ({"name": "adamw8bit", "stochastic_rounding": True}, BF16),
    ({"stochastic_rounding": True}, {"model": {"policy": {"preset": "tiny"}}, "trainer": {"precision": "bf16-true"}}),
    ({"stochastic_rounding": True}, {"model": {"policy": {"preset": "tiny", "dtype": "bfloat16"}}}),
    ({}, {"model": {"policy": {"preset": "tiny", "dtype": "bfloat16", "lora": {}}},
          "trainer": {"precision": "bf16-mixed"}})])
def test_runnable_settings_have_no_problems(optimizer, sections):
    assert optimizer_problems(cfg_with(optimizer, **sections)) == []


def test_cpu_offload_in_several_processes_is_a_problem():
    cfg = cfg_with({"cpu_offload": True}, trainer={"accelerator": "cpu", "devices": 2})
    assert not any("single process" in p for p in optimizer_problems(cfg))   # no CUDA: that line only
    assert any(p.startswith("optimizer.cpu_offload: true runs in a single process")
               for p in optimizer_problems({**cfg, "trainer": {**cfg["trainer"], "accelerator": "gpu"}}))
    assert any("single process" in p for p in optimizer_problems(
        {**cfg, "trainer": {**cfg["trainer"], "accelerator": "gpu", "devices": 1}}, world_size=2))


def test_fit_without_torchao_is_one_error_line_and_its_import_is_quiet(tmp_path, chats):
    """A child process: `fw fit` with torchao hidden from the import system prints one line and exits with 2;
    then torchao, visible again, imports through fw without a word (it logs its C++ extensions failing to
    load against this torch build)."""
    code = ("import sys; sys.modules['torchao'] = None; from framework.cli import main; "
            f"code = main(['fit', '--config', 'recipes/sft.yaml', '--run_dir={tmp_path / 'run'}', "
            f"'--data.path={chats}', '--trainer.accelerator=cpu', '--trainer.max_steps=1', "
            "'--trainer.enable_progress_bar=false', '--optimizer.name=adamw8bit']); "
            "print('IMPORT', file=sys.stderr, flush=True); del sys.modules['torchao']; "
            "from framework.optim import _torchao_optim; _torchao_optim(); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    fit_err, import_err = proc.stderr.split("IMPORT\n")
    # one problem line, as the config's validation reports it (the key came from an override)
    lines = fit_err.splitlines()
    expected = "override '--optimizer.name=adamw8bit': optimizer.name: adamw8bit needs torchao: pip install 'fw[lean]'"
    assert lines == [expected], proc.stderr
    assert "Traceback" not in fit_err
    assert import_err == "", import_err


# ------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_cpu_offload_steps_like_the_on_device_optimizer(name):
    """The offloaded optimizer (weight on the CPU, gain on the GPU) takes the steps of the same optimizer
    on the GPU, its param_groups show the finished host gradients to clipping, and Lightning accepts it."""
    from lightning.fabric.utilities.types import Optimizable

    cfg = cfg_with({"name": name, "cpu_offload": True, "fused": False}, trainer={"accelerator": "gpu"})
    on_device_cfg = cfg_with({"name": name, "fused": False}, trainer={"accelerator": "gpu"})
    model, twin = Pair().cuda(), Pair().cuda()
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    twin_opt = build_optimizer(twin, on_device_cfg["optimizer"], on_device_cfg)
    assert isinstance(opt, Optimizable) and isinstance(opt, torch.optim.Optimizer)
    assert {p.device.type for g in opt.param_groups for p in g["params"]} == {"cpu", "cuda"}
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        for m in (model, twin):
            ((x @ m.weight.T).square().mean() * m.gain.sum()).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.5)
        twin_norm = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.5)
        torch.testing.assert_close(norm.cpu(), twin_norm.cpu(), rtol=1e-5, atol=0)
        opt.step()
        twin_opt.step()
        opt.zero_grad()
        twin_opt.zero_grad()
    start = Pair().cuda()
    for p, q, p0 in zip(model.parameters(), twin.parameters(), start.parameters()):
        if name == "adamw":
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        else:   # CPU and CUDA float rounding may flip an 8-bit code now and then
            assert float((p - q).norm() / (q - p0).norm()) < 1e-3
    state = opt.state_dict()
    fresh = build_optimizer(Pair().cuda(), cfg["optimizer"], cfg)
    fresh.load_state_dict(state)
    assert same_state(fresh.state_dict(), state)
    assert all(t.device.type == "cuda" for s in opt.state.values() for t in s.values() if t.ndim)


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="on the H200 the resumed run's step-6 weights differ from the straight run's "
                   "(the resume itself completes); the cause is not found yet")
def test_cpu_offload_fit_resumes_exactly(tmp_path, chats):
    """fw fit on the GPU with the states offloaded: 6 steps straight equal 4 (resumed from 3) + 3."""
    optimizer = {"name": "adamw8bit", "stochastic_rounding": True, "cpu_offload": True}
    gpu = {"accelerator": "gpu", "devices": 1}
    fit(sft(tmp_path / "straight", chats, optimizer, 6, **gpu))
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 4}}
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(sft(tmp_path / "broken", chats, optimizer, 6, [crash], **gpu))
    trainer = fit(sft(tmp_path / "broken", chats, optimizer, 6, **gpu), resume="last")
    assert trainer.global_step == 6

    def final(run):
        return load_file(str(tmp_path / run / "checkpoints/step-000006/policy/model.safetensors"))

    a, b = final("straight"), final("broken")
    assert all(torch.equal(a[k], b[k]) for k in a)
