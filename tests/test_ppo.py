"""PPO on CPU: policy and critic gradients vs an independent float64 computation (advantages pinned
across epochs), policy-step counting with two optimizers, the critic in every checkpoint."""
import copy
import math
import shutil
from typing import ClassVar

import pytest
import torch
from test_grpo import token_logprobs

from framework.callbacks import Callback
from framework.cli import main
from framework.config import resolve
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.trainer import fit


def config(run_dir, callbacks=(), recipe="ppo", **sections):
    cfg = {
        "recipe": recipe, "seed": 2, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "digits", "init_args": {"num_digits": 2, "rule": "sum"}}, "chat_template": False},
        "rollout": {"prompts_per_step": 8, "max_new_tokens": 4, "temperature": 1.1},
        "reward": {"name": "numeric_match"},
        "optimizer": {"lr": 1e-2, "max_grad_norm": None},
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 100, "keep_last": None},
        "logging": {"csv": False, "tensorboard": False},
        "callbacks": list(callbacks),
    }
    if recipe == "ppo":
        cfg["ppo"] = {"critic": {"lr": 1e-2, "max_grad_norm": None}}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return resolve(cfg)


def _token_values(model, data):
    values = model(data.tokens)
    return [[values[b, int(data.prompt_lens[b]) + j - 1] for j in range(int(data.completion_lens[b]))]
            for b in range(data.tokens.shape[0])]


class PPOProbe(Callback):
    """Snapshots the rollout's advantages/returns from float64 copies before any update, then checks the
    gradients of the second policy step and the second critic step (epoch 2: ratio != 1, critic moved)."""

    results: ClassVar[list] = []

    def before_optimizer_step(self, trainer, module, optimizer):
        role, p, data = module.optimizer_role(optimizer), module.cfg["ppo"], module.recipe.last_rollout
        temperature = module.cfg["rollout"]["temperature"]
        if role == "policy" and module.policy_version == 0:
            with torch.no_grad():
                ref = token_logprobs(copy.deepcopy(module.reference).double(), data, temperature)
                values = [[float(v) for v in row] for row in _token_values(copy.deepcopy(module.value).double(), data)]
            adv_rows, ret_rows = [], []
            for b, row_values in enumerate(values):
                n = len(row_values)
                rewards = []
                for j in range(n):
                    old = float(data.old_logp[b, j])
                    r = -p["kl_coef"] * (old - float(ref[b][j]))   # k1 = logp - ref_logp
                    if j == n - 1:
                        r += float(data.rewards[b])
                    rewards.append(r)
                adv, running = [0.0] * n, 0.0
                for t in reversed(range(n)):
                    next_v = row_values[t + 1] if t + 1 < n else 0.0
                    running = rewards[t] + p["gamma"] * next_v - row_values[t] + p["gamma"] * p["lam"] * running
                    adv[t] = running
                adv_rows.append(adv)
                ret_rows.append([a + v for a, v in zip(adv, row_values)])
            flat = [a for row in adv_rows for a in row]
            mean = sum(flat) / len(flat)
            std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat) + 1e-8)
            self.adv = [[(a - mean) / std for a in row] for row in adv_rows]
            self.returns, self.old_values = ret_rows, values
        elif role == "policy" and module.policy_version == 1:
            policy = copy.deepcopy(module.policy).double()
            lp = token_logprobs(policy, data, temperature)
            terms = []
            for b, row in enumerate(lp):
                for j, logp in enumerate(row):
                    ratio = torch.exp(logp - float(data.old_logp[b, j]))
                    a = self.adv[b][j]
                    clipped = ratio.clamp(1 - p["clip_eps_low"], 1 + p["clip_eps_high"])
                    terms.append(-torch.minimum(ratio * a, clipped * a))
            (sum(terms) / len(terms)).backward()
            PPOProbe.results.append(("policy", _worst(policy, module.policy)))
        elif role == "critic" and module.policy_version == 2:   # the second critic step follows policy step 2
            value = copy.deepcopy(module.value).double()
            terms, clipped = [], 0
            for b, row in enumerate(_token_values(value, data)):
                for j, v in enumerate(row):
                    old, ret = self.old_values[b][j], self.returns[b][j]
                    v_clip = old + (v - old).clamp(-p["value_clip"], p["value_clip"])
                    err, err_clip = (v - ret) ** 2, (v_clip - ret) ** 2
                    clipped += int(err_clip.item() > err.item())
                    terms.append(0.5 * torch.maximum(err, err_clip))
            (p["vf_coef"] * sum(terms) / len(terms)).backward()
            PPOProbe.results.append(("critic", _worst(value, module.value), clipped))


def _worst(reference, model):
    got = dict(model.named_parameters())
    return max(float((p.grad - got[n].grad.double()).abs().max() / p.grad.abs().max().clamp(min=1e-12))
               for n, p in reference.named_parameters() if p.grad is not None)


def test_policy_and_critic_gradients_match_float64_reference(tmp_path):
    PPOProbe.results = []
    probe = {"class_path": "test_ppo.PPOProbe", "init_args": {}}
    cfg = config(tmp_path / "run", [probe], reward={"name": None, "class_path": "test_grpo.LetterReward"},
                 ppo={"epochs": 2, "minibatches": 1, "kl_coef": 0.2, "kl_estimator": "k1", "gamma": 0.9,
                      "lam": 0.8, "value_clip": 0.05, "vf_coef": 0.7, "clip_eps_low": 0.1, "clip_eps_high": 0.15,
                      "critic": {"lr": 1e-2, "max_grad_norm": None}})
    trainer = fit(cfg)
    assert trainer.global_step == 2 and trainer.lightning_module.policy_version == 2
    results = {r[0]: r[1:] for r in PPOProbe.results}
    assert results["policy"][0] < 1e-4
    assert results["critic"][0] < 1e-4
    assert results["critic"][1] > 0   # the value clip is exercised


def test_critic_in_checkpoints_and_policy_steps_counted(tmp_path):
    run = tmp_path / "run"
    cfg = config(run, ppo={"epochs": 1, "minibatches": 2, "kl_coef": 0.05},
                 trainer={"accelerator": "cpu", "max_steps": 3, "enable_progress_bar": False},
                 checkpoint={"every_n_steps": 2, "keep_last": None})
    trainer = fit(cfg)
    # 2 policy + 2 critic steps per rollout; max_steps counts policy steps only
    assert trainer.global_step == 3 and trainer.lightning_module.policy_version == 3
    ckpt = run / "checkpoints" / "step-000003"
    assert (ckpt / "value" / "model.safetensors").is_file() and (ckpt / "value" / "config.json").is_file()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    policy_state, critic_state = state["optimizer_states"]
    steps = {int(s["step"]) for s in critic_state["state"].values()}
    assert steps == {3}   # the critic stepped with every policy step, including the cut-short rollout
    assert {int(s["step"]) for s in policy_state["state"].values()} == {3}

    # resuming continues with the critic restored; a checkpoint without value/ is refused
    trainer = fit(config(run, ppo={"epochs": 1, "minibatches": 2, "kl_coef": 0.05},
                         trainer={"accelerator": "cpu", "max_steps": 4, "enable_progress_bar": False},
                         checkpoint={"every_n_steps": 2, "keep_last": None}), resume="last")
    assert trainer.global_step == 4

    grpo_run = tmp_path / "grpo"
    fit(config(grpo_run, recipe="grpo", grpo={"group_size": 2}))
    with pytest.raises(FwError, match="value"):
        fit(config(tmp_path / "ppo2"), resume=str(grpo_run / "checkpoints" / "step-000002"))

    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "step-000002", broken / "checkpoints" / "step-000002")
    shutil.rmtree(broken / "checkpoints" / "step-000002" / "value")
    with pytest.raises(FwError, match="value"):
        fit(config(broken), resume=str(broken / "checkpoints" / "step-000002"))


def test_reward_kl_is_zero_while_the_policy_equals_the_reference(tmp_path):
    # Both logprobs come from the same forward path, so KL(pi || pi) is exactly 0 at the first rollout
    # (taking the policy side from the rollout's KV-cache decode would leave its rounding mismatch in).
    cfg = config(tmp_path / "run", ppo={"kl_coef": 0.1, "kl_estimator": "k1",
                                        "critic": {"lr": 1e-2, "max_grad_norm": None}},
                 trainer={"max_steps": 1, "log_every_n_steps": 1})
    fit(cfg)
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["policy/ref_kl"] == 0.0


class _Ctx:
    """The StepContext of a training step that takes no optimizer step: a rollout batch's advantages only."""

    policy = value = reference = None
    device = torch.device("cpu")
    rank, world_size, policy_version = 0, 1, 0

    def __init__(self):
        self.logged = {}

    def log(self, name, value, weight=None, reduce="mean"):
        self.logged[name] = float(value)

    def steps_left(self):
        return False


@pytest.mark.parametrize("dropped_by", ["mask_truncated", "sequence_is_mask", "token_is_mask"])
def test_whitening_statistics_cover_only_the_tokens_in_the_loss(tmp_path, dropped_by):
    """Row 2 leaves the loss (cut at max_new_tokens, or its logprob ratio outside [low, high]): the whitening's
    mean and variance are those of the other rows' tokens, as the loss's mask and denominators are."""
    from framework.tokenizer import Tokenizer
    from recipes.ppo import PPORecipe
    from recipes.rl import ScoredRollout

    ppo = {"samples_per_prompt": 2, "gamma": 1.0, "lam": 1.0, "kl_coef": 0.0, "whiten_advantages": True,
           "critic": {"lr": 1e-2, "max_grad_norm": None}}
    if dropped_by == "mask_truncated":
        ppo["overlong"] = {"mask_truncated": True}
    else:
        ppo["off_policy_correction"] = {"name": "mask", "low": 0.5, "high": 2.0,
                                        "level": "sequence" if dropped_by == "sequence_is_mask" else "token"}
    cfg = config(tmp_path / "run", rollout={"prompts_per_step": 2, "max_new_tokens": 4, "temperature": 1.0}, ppo=ppo)
    recipe = PPORecipe(cfg, Tokenizer.builtin())
    lens = torch.tensor([2, 3, 4, 3])
    mask = (torch.arange(4)[None, :] < lens[:, None]).float()
    old_logp = -1.0 * mask
    data = ScoredRollout(
        tokens=torch.full((4, 5), 7), prompt_lens=torch.ones(4, dtype=torch.long), completion_lens=lens,
        old_logp=old_logp, mask=mask, rewards=torch.tensor([1.0, 0.0, 5.0, 2.0]),
        correct=torch.tensor([True, False, True, True]), n_reward_errors=0, eos_frac=0.75,
        truncated=torch.tensor([False, False, True, False]), gen_seconds=1.0, texts=["a", "b", "c", "d"])
    # the trainer's logprobs: row 2's ratio is e per token (e^4 for the row), outside [0.5, 2]; the others' are 1
    trainer_logp = old_logp + torch.tensor([0.0, 0.0, 1.0, 0.0])[:, None] * mask
    recipe.collect = lambda ctx, samples: data
    recipe.values = lambda model, batch, rows=None: torch.zeros_like(batch.mask)   # critic: V = 0
    recipe.logprobs = lambda model, batch, rows=None, with_entropy=False: (trainer_logp, None)
    ctx = _Ctx()
    recipe.training_step(ctx, 0, 0)

    # gamma = lam = 1, V = 0: each token's advantage is its row's reward. The kept tokens (rows 0, 1, 3) are
    # 1, 1, 0, 0, 0, 2, 2, 2: mean 8 / 8 = 1, population variance (0 + 0 + 1 + 1 + 1 + 1 + 1 + 1) / 8 = 0.75.
    kept = [1.0, 1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    mean = math.fsum(kept) / len(kept)
    var = math.fsum((a - mean) ** 2 for a in kept) / len(kept)
    assert (mean, var) == (1.0, 0.75)
    scale = 1.0 / math.sqrt(var + 1e-8)   # whiten's eps
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0],
                             [-scale, -scale, -scale, 0.0],
                             [0.0, 0.0, 0.0, 0.0],   # out of the loss: 0, as past a row's end
                             [scale, scale, scale, 0.0]], dtype=torch.float64)
    got = recipe.last_advantages.double()
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), got
    # the logged mean |A| is over the same tokens: 6 of the 8 kept ones at |A| = scale
    assert ctx.logged["policy/adv_abs"] == pytest.approx(6 * scale / 8, abs=1e-6)


def test_a_zero_vf_coef_is_refused(tmp_path, capsys):
    # vf_coef scales the critic's loss before its backward: at 0 the critic gets no gradient and never learns
    path = tmp_path / "train.yaml"
    path.write_text("recipe: ppo\nmodel:\n  policy: {preset: tiny}\ndata:\n  task: {name: digits}\n"
                    f"run_dir: {tmp_path / 'run'}\nppo:\n  vf_coef: 0\n")
    assert main(["validate", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{path}:8:12: ppo.vf_coef: must be > 0, got 0"]
    assert main(["validate", "--config", str(path), "--ppo.vf_coef=0.01"]) == 0
