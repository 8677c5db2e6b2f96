"""The RL options of issue 30 against hand-computed values, against the peers' published formulas written
out here (verl's dual clip, rollout IS and DAPO overlong reward; TRL's truncated IS), and through `fw fit`:
float64 gradients with every loss option on, dynamic sampling's rounds and its exact resume."""
import copy
import math
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file
from test_grpo import config, hand_group_advantages, token_logprobs

from framework.callbacks import Callback
from framework.cli import main
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.module import FwModule
from framework.trainer import fit
from recipes.advantages import grpo_advantages, overlong_penalty
from recipes.grpo import informative_groups
from recipes.losses import ClippedSurrogate, OffPolicyCorrection, loss_inputs

TIMING = {"tokens_per_s", "rollout/tokens_per_s", "rollout/seconds"}
STOP = list("abcdefghijklmnopqrstuvwxyz")   # about a quarter of the built-in vocabulary ends a completion


# ------------------------------------------------------------------------------------ dual clip


def test_dual_clip_hand_computed():
    # eps 0.2, c 3: token 0 (A=-1, rho 4): -min(-4, -1.2) = 4 -> capped at 3 (dual clip, no gradient);
    # token 1 (A=-1, rho 2): 2 < 3, unchanged; token 2 (A=+1, rho 4): clipped to 1.2 (positive A: no dual)
    logp = torch.log(torch.tensor([[4.0, 2.0, 4.0]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = ClippedSurrogate(0.2, 0.2, "token-mean", clip_ratio_c=3.0)(logp, torch.zeros(1, 3), adv, torch.ones(1, 3))
    assert float(out.loss.detach()) == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-6)
    assert float(out.dual_clip_frac) == pytest.approx(1 / 3)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-6)
    off = ClippedSurrogate(0.2, 0.2, "token-mean")(logp.detach(), torch.zeros(1, 3), adv, torch.ones(1, 3))
    assert float(off.loss) == pytest.approx((4.0 + 2.0 - 1.2) / 3, abs=1e-6) and float(off.dual_clip_frac) == 0.0


def verl_dual_clip_loss(log_prob, old_log_prob, advantages, mask, low, high, c):
    """verl's compute_policy_loss (vanilla), written out: pg_losses3 = -A * c bounds the clipped loss
    for negative advantages; token-mean aggregation over the response mask."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    lower_frac = ((clip_pg_losses1 > pg_losses3) & (advantages < 0)).double().mul(mask).sum() / mask.sum()
    return (pg_losses * mask).sum() / mask.sum(), lower_frac


def test_dual_clip_matches_verl_on_random_inputs():
    g = torch.Generator().manual_seed(5)
    logp = torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.8
    old = torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.8
    adv = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.25).double()
    ours = ClippedSurrogate(0.2, 0.28, "token-mean", clip_ratio_c=3.0)(logp, old, adv, mask)
    theirs, frac = verl_dual_clip_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    assert float(frac) > 0   # the inputs reach the dual clip
    assert float(ours.loss) == pytest.approx(float(theirs), rel=1e-12)
    assert float(ours.dual_clip_frac) == pytest.approx(float(frac), rel=1e-6)


# ------------------------------------------------------------------------------------ off-policy correction


def test_tis_and_mask_token_level_hand_computed():
    # trainer - behaviour log-ratios 0.5, 0, -1, 2 (ratios 1.6487, 1, 0.3679, 7.389); the 4th token is padding
    behaviour = torch.zeros(2, 2)
    trainer = torch.tensor([[0.5, 0.0], [-1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tis = OffPolicyCorrection("tis", cap=1.5, low=0.5, high=2.0, level="token")(trainer, behaviour, mask)
    assert tis.weight.flatten().tolist() == pytest.approx([1.5, 1.0, math.exp(-1.0), 0.0], abs=1e-6)
    assert tis.mask.tolist() == mask.tolist()
    assert float(tis.capped_frac) == pytest.approx(1 / 3)
    assert float(tis.ratio_mean) == pytest.approx((math.exp(0.5) + 1 + math.exp(-1)) / 3, abs=1e-6)
    mis = OffPolicyCorrection("mask", cap=1.5, low=0.5, high=2.0, level="token")(trainer, behaviour, mask)
    assert mis.mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]    # exp(-1) < 0.5 is dropped
    assert mis.weight.flatten().tolist() == pytest.approx([math.exp(0.5), 1.0, 0.0, 0.0], abs=1e-6)
    assert float(mis.masked_frac) == pytest.approx(1 / 3)


def test_sequence_level_hand_computed():
    # row 0: log-ratios 0.3 + 0.4 = 0.7 (ratio 2.0138 > cap 2); row 1: -0.2 + (padding) = -0.2 (0.8187)
    behaviour = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    trainer = behaviour + torch.tensor([[0.3, 0.4], [-0.2, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tis = OffPolicyCorrection("tis", cap=2.0, low=0.9, high=2.5, level="sequence")(trainer, behaviour, mask)
    assert tis.weight.flatten().tolist() == pytest.approx([2.0, 2.0, math.exp(-0.2), 0.0], abs=1e-6)
    assert float(tis.capped_frac) == pytest.approx(2 / 3)
    mis = OffPolicyCorrection("mask", cap=2.0, low=0.9, high=2.5, level="sequence")(trainer, behaviour, mask)
    assert mis.mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]    # 0.8187 < 0.9: the whole row goes
    assert mis.weight[0].tolist() == pytest.approx([math.exp(0.7)] * 2, abs=1e-5)


def verl_rollout_is(old_log_prob, rollout_log_prob, response_mask, level, mode, upper, lower):
    """verl's compute_rollout_importance_weights, written out: log-ratios bounded to +-20, a sequence's
    summed; truncate clamps at the upper threshold, mask rejects outside [lower, upper] through the
    response mask and keeps the true ratios as weights; padding zeroed."""
    log_ratio = old_log_prob - rollout_log_prob
    if level == "sequence":
        log_ratio = (log_ratio * response_mask).sum(-1, keepdim=True)
    weights = torch.exp(log_ratio.clamp(-20.0, 20.0)).expand_as(old_log_prob)
    if mode == "truncate":
        weights, new_mask = weights.clamp(max=upper), response_mask
    else:
        new_mask = response_mask * ((weights >= lower) & (weights <= upper)).to(response_mask.dtype)
    return weights * response_mask, new_mask


def trl_truncated_is(old_per_token_logps, sampling_per_token_logps, cap):
    """TRL's vLLM importance-sampling correction (token truncate): exp(old - sampling) clamped at cap."""
    return torch.exp(old_per_token_logps - sampling_per_token_logps).clamp(max=cap)


@pytest.mark.parametrize("name, level", [("tis", "token"), ("tis", "sequence"), ("mask", "token"),
                                         ("mask", "sequence")])
def test_correction_matches_verl_and_trl_on_random_inputs(name, level):
    g = torch.Generator().manual_seed(11)
    behaviour = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    trainer = behaviour + torch.randn(5, 7, generator=g, dtype=torch.float64) * (0.6 if level == "token" else 0.3)
    logp = trainer + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(5, generator=g, dtype=torch.float64)
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 3, 5, 1, 6])[:, None]).double()
    c = OffPolicyCorrection(name, cap=1.7, low=0.6, high=1.7, level=level)(trainer, behaviour, mask)
    weights, peer_mask = verl_rollout_is(trainer, behaviour, mask, level, "truncate" if name == "tis" else "mask",
                                         1.7, 0.6)
    if name == "tis" and level == "token":
        assert torch.allclose(weights, trl_truncated_is(trainer, behaviour, 1.7) * mask, atol=1e-12)
        assert 0 < float(c.capped_frac) < 1
    if name == "mask":
        assert 0 < float(c.masked_frac) < 1
    assert torch.equal(c.mask, peer_mask.float())
    # the policy loss verl computes: per-token clipped loss x IS weight, token-mean over its response mask
    loss_fn = ClippedSurrogate(0.2, 0.2, "token-mean")
    ours = loss_fn(logp, trainer, adv, c.mask.double(), c.weight.double())
    a = adv[:, None].expand_as(logp)
    ratio = torch.exp(logp - trainer)
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * weights
    theirs = (per_token * peer_mask).sum() / peer_mask.sum()
    assert float(ours.loss) == pytest.approx(float(theirs), rel=1e-6)


def test_loss_inputs_without_correction_never_runs_the_trainer_pass():
    section = {"overlong": {"mask_truncated": True, "buffer": None, "penalty_factor": 1.0},
               "off_policy_correction": {"name": "none", "cap": 2.0, "low": 0.5, "high": 2.0, "level": "token"}}
    behaviour = torch.randn(3, 2)
    mask = torch.ones(3, 2)

    def no_pass():
        raise AssertionError("the trainer's logprobs are not needed")

    out = loss_inputs(section, behaviour, mask, torch.tensor([False, True, False]), no_pass)
    assert out.old_logp is behaviour and out.weight is None and out.metrics == {}
    assert out.mask.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


# ------------------------------------------------------------------------------------ advantages and rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-4])
def test_a_tied_group_gives_exactly_zero(scale, eps):
    # float32 0.1 * 3 / 3 is not 0.1: a float mean would leave ~1e-9 and eps 1e-12 would blow it up
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.1])
    adv = grpo_advantages(rewards, 3, scale, eps)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    r = [float(x) for x in rewards[3:].double()]   # the float32 rewards, exactly, in float64
    mean = sum(r) / 3
    std = {"group": math.sqrt(sum((x - mean) ** 2 for x in r) / 2),
           "batch": float(rewards.double().std()), "none": None}[scale]
    expected = [(x - mean) / (std + eps) if std is not None else x - mean for x in r]
    assert adv[3:].tolist() == pytest.approx(expected, rel=1e-6)


def dapo_overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, penalty_factor):
    """verl's DAPO reward manager, written out: min(-exceed_len / buffer_len * penalty_factor, 0)."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * penalty_factor, 0)


def test_overlong_penalty_hand_computed_and_as_dapo():
    lens = torch.tensor([1, 6, 7, 9, 10])
    # max 10, buffer 4: no penalty up to 6 tokens, then -0.5 * (len - 6) / 4
    assert overlong_penalty(lens, 10, 4, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5])
    assert overlong_penalty(lens, 10, 4, 0.5).tolist() == pytest.approx(
        [dapo_overlong_reward(int(n), 10, 4, 0.5) for n in lens])
    with pytest.raises(ValueError, match="buffer 11"):
        overlong_penalty(lens, 10, 11, 1.0)


def test_informative_groups_keep_draw_order_and_fill_with_tied_ones():
    # groups of 2: tied, informative, tied, informative, informative
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.2])
    assert informative_groups(rewards, 2, 2).tolist() == [1, 3]
    assert informative_groups(rewards, 2, 3).tolist() == [1, 3, 4]
    assert informative_groups(rewards, 2, 4).tolist() == [0, 1, 3, 4]   # one tied group fills the batch


# ------------------------------------------------------------------------------------ through fit


def expected_truncated(tok, data, max_new):
    """Rows that ran to max_new_tokens without EOS or a stop string in their text, read from the tokens."""
    out = []
    for b in range(data.tokens.shape[0]):
        n, p = int(data.completion_lens[b]), int(data.prompt_lens[b])
        text = tok.decode(data.tokens[b, p:p + n].tolist())
        out.append(n == max_new and int(data.tokens[b, p + n - 1]) != tok.eos_id and not any(s in text for s in STOP))
    return out


class OptionsProbe(Callback):
    """Recomputes the GRPO gradient of policy step 2 (second epoch on one rollout) in float64 with the
    overlong penalty, the truncation mask, the off-policy correction (pi_old = the trainer's logprobs
    before the first step) and the dual clip written out per token, and compares."""

    results: ClassVar[list] = []

    def before_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy":
            return
        cfg, data = module.cfg, module.recipe.last_rollout
        g, temperature = cfg["grpo"], cfg["rollout"]["temperature"]
        if module.policy_version == 0:
            with torch.no_grad():
                self.old = token_logprobs(copy.deepcopy(module.policy).double(), data, temperature)
            return
        if module.policy_version != 1:
            return
        tok, max_new = module.tokenizer, cfg["rollout"]["max_new_tokens"]
        o, corr, c = g["overlong"], g["off_policy_correction"], g["clip_ratio_c"]
        truncated = expected_truncated(tok, data, max_new)
        rewards = [float(r) - o["penalty_factor"] * max(0, int(n) - (max_new - o["buffer"])) / o["buffer"]
                   for r, n in zip(data.rewards.double(), data.completion_lens)]
        adv = hand_group_advantages(rewards, g["group_size"], g["adv_eps"])
        policy = copy.deepcopy(module.policy).double()
        lp = token_logprobs(policy, data, temperature)
        terms, dual, dropped = [], 0, 0
        for b, tokens in enumerate(lp):
            if truncated[b]:
                continue
            log_ratios = [float(self.old[b][j]) - float(data.old_logp[b, j]) for j in range(len(tokens))]
            if corr["level"] == "sequence":
                log_ratios = [sum(log_ratios)] * len(tokens)
            for j, logp in enumerate(tokens):
                is_ratio = math.exp(log_ratios[j])
                if corr["name"] == "mask" and not corr["low"] <= is_ratio <= corr["high"]:
                    dropped += 1
                    continue
                weight = min(is_ratio, corr["cap"]) if corr["name"] == "tis" else is_ratio
                ratio = torch.exp(logp - float(self.old[b][j]))
                a = adv[b]
                term = -torch.minimum(ratio * a, ratio.clamp(1 - g["clip_eps_low"], 1 + g["clip_eps_high"]) * a)
                if a < 0 and float(term.detach()) > -c * a:
                    term, dual = term * 0 - c * a, dual + 1
                terms.append(term * weight)
        loss = sum(terms) / len(terms)
        loss.backward()
        got = dict(module.policy.named_parameters())
        worst = max(float((p.grad - got[n].grad.double()).abs().max() / p.grad.abs().max().clamp(min=1e-12))
                    for n, p in policy.named_parameters())
        OptionsProbe.results.append({"worst_rel": worst, "dual": dual, "truncated": sum(truncated),
                                     "rows": len(truncated), "dropped": dropped,
                                     "flags": data.truncated.tolist() == truncated})


@pytest.mark.parametrize("correction", [{"name": "tis", "cap": 2.0, "level": "token"},
                                        {"name": "mask", "low": 0.5, "high": 2.0, "level": "sequence"}])
def test_every_loss_option_matches_a_float64_gradient(tmp_path, correction, monkeypatch):
    OptionsProbe.results = []
    probe = {"class_path": "test_rl_breadth.OptionsProbe"}
    cfg = config(tmp_path / "run", [probe], reward={"name": None, "class_path": "test_grpo.LetterReward"},
                 rollout={"prompts_per_step": 4, "max_new_tokens": 3, "temperature": 0.9, "stop": STOP},
                 grpo={"group_size": 4, "epochs": 2, "clip_ratio_c": 1.01,
                       "overlong": {"mask_truncated": True, "buffer": 2, "penalty_factor": 0.5},
                       "off_policy_correction": correction},
                 trainer={"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False,
                          "accumulate_grad_batches": 2})
    trainer = fit(cfg)
    [result] = OptionsProbe.results
    assert result["flags"]                              # the rollout's truncation flags, read independently
    assert 0 < result["truncated"] < result["rows"]     # some rows dropped, some trained on
    assert result["dual"] > 0                           # the dual clip is active on some tokens
    assert result["worst_rel"] < 1e-4
    [record] = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1:]
    assert record["rollout/truncated_frac"] == pytest.approx(result["truncated"] / result["rows"])
    assert record["policy/dual_clip_frac"] > 0 and record["reward/overlong_penalty_mean"] < 0
    assert ("policy/tis_capped_frac" if correction["name"] == "tis" else "policy/masked_frac") in record
    assert record["policy/is_ratio"] == pytest.approx(1.0, abs=1e-4)   # CPU: rollout and trainer agree
    assert trainer.global_step == 2


class ParityReward:
    """1 when the completion starts with an even code point: a coin flip per sample under a random-init
    policy, so a group of 2 ties about half the time."""

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        return float(bool(completion) and ord(completion[0]) % 2 == 0)


class TrainedGroups(Callback):
    """Per policy step: the data position before the step, the trained batch's rewards and prompts."""

    steps: ClassVar[list] = []

    def after_optimizer_step(self, trainer, module, optimizer):
        data = module.recipe.last_rollout
        prompts = [module.tokenizer.decode(data.tokens[b, :int(data.prompt_lens[b])].tolist())
                   for b in range(data.tokens.shape[0])]
        TrainedGroups.steps.append({"position": module.recipe.prompt_position, "rewards": data.rewards.tolist(),
                                    "prompts": prompts})


def dynamic_config(run_dir, callbacks=(), **trainer):
    return config(run_dir, callbacks, reward={"name": None, "class_path": "test_rl_breadth.ParityReward"},
                  rollout={"prompts_per_step": 2, "max_new_tokens": 2, "temperature": 1.0},
                  grpo={"group_size": 2, "dynamic_sampling": True, "dynamic_sampling_max_rounds": 4},
                  trainer={"accelerator": "cpu", "max_steps": 6, "enable_progress_bar": False, **trainer},
                  checkpoint={"every_n_steps": 2, "keep_last": None})


def test_dynamic_sampling_draws_until_groups_differ_and_resumes_exactly(tmp_path):
    from framework.tasks import build_task

    TrainedGroups.steps = []
    straight = tmp_path / "straight"
    fit(dynamic_config(straight, [{"class_path": "test_rl_breadth.TrainedGroups"}]))
    records = read_metrics(straight / "metrics.jsonl")
    rounds = [int(r["rollout/rounds"]) for r in records]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert max(rounds) > 1 and all(1 <= n <= 4 for n in rounds)
    task = build_task(config(tmp_path / "x")["data"], seed=1)
    position = 0
    for record, step, n in zip(records, TrainedGroups.steps, rounds):
        assert step["position"] == position and record["rollout/groups_drawn"] == 2 * n
        groups = [step["rewards"][i:i + 2] for i in (0, 2)]
        tied = sum(a == b for a, b in groups)
        assert record["rollout/uninformative_frac"] == tied / 2
        assert tied == 0 or n == 4   # tied groups are kept only when the rounds ran out
        drawn = {task.sample(i)["prompt"] for i in range(position, position + 2 * n)}
        assert set(step["prompts"]) <= drawn   # the trained prompts come from this step's rounds
        position += 2 * n

    broken = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(dynamic_config(broken, [{"class_path": "test_resume.CrashAt", "init_args": {"step": 5}}]))
    state = torch.load(broken / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert state["fw_recipe"] == {"rollout_step": 4, "prompt_position": 2 * sum(rounds[:4])}
    fit(dynamic_config(broken), resume="last")

    def comparable(run):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]

    assert comparable(broken) == comparable(straight)
    a, b = (load_file(str(run / "checkpoints" / "step-000006" / "policy" / "model.safetensors"))
            for run in (straight, broken))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class ReturnsProbe(Callback):
    """Before PPO's first policy step: GAE's raw advantages plus the critic's old values (gamma = lam = 1,
    no KL) are each token's return, the sequence reward plus the overlong penalty, computed here by hand."""

    results: ClassVar[list] = []

    def before_optimizer_step(self, trainer, module, optimizer):
        from recipes.rl import completion_values

        if module.optimizer_role(optimizer) != "policy" or module.policy_version != 0:
            return
        data, cfg = module.recipe.last_rollout, module.cfg
        o, max_new = cfg["ppo"]["overlong"], cfg["rollout"]["max_new_tokens"]
        with torch.no_grad():
            values = completion_values(module.value, data.tokens, data.prompt_lens, data.completion_lens,
                                       data.mask.shape[1])
        returns = (module.recipe.last_advantages_raw + values) * data.mask
        worst, penalties = 0.0, []
        for b in range(data.tokens.shape[0]):
            n = int(data.completion_lens[b])
            penalty = -o["penalty_factor"] * max(0, n - (max_new - o["buffer"])) / o["buffer"]
            penalties.append(penalty)
            worst = max(worst, max(abs(float(returns[b, j]) - (float(data.rewards[b]) + penalty)) for j in range(n)))
        truncated = expected_truncated(module.tokenizer, data, max_new)
        ReturnsProbe.results.append({"worst": worst, "penalty": sum(penalties) / len(penalties),
                                     "truncated": sum(truncated) / len(truncated),
                                     "flags": data.truncated.tolist() == truncated})


def test_ppo_options_through_fit(tmp_path):
    from test_ppo import config as ppo_config

    ReturnsProbe.results = []
    cfg = ppo_config(tmp_path / "run", [{"class_path": "test_rl_breadth.ReturnsProbe"}],
                     rollout={"prompts_per_step": 8, "max_new_tokens": 4, "temperature": 1.1, "stop": STOP},
                     ppo={"critic": {"lr": 1e-2, "max_grad_norm": None}, "gamma": 1.0, "lam": 1.0, "kl_coef": 0.0,
                          "clip_ratio_c": 3.0, "overlong": {"mask_truncated": True, "buffer": 3, "penalty_factor": 0.5},
                          "off_policy_correction": {"name": "tis", "cap": 2.0, "level": "sequence"}},
                     trainer={"accelerator": "cpu", "max_steps": 1, "enable_progress_bar": False})
    fit(cfg)
    [result] = ReturnsProbe.results
    assert result["flags"] and result["worst"] < 1e-5 and result["penalty"] < 0
    [record] = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["reward/overlong_penalty_mean"] == pytest.approx(result["penalty"], abs=1e-6)
    assert record["rollout/truncated_frac"] == pytest.approx(result["truncated"])
    for key in ("policy/tis_capped_frac", "policy/is_ratio", "policy/dual_clip_frac", "value/loss"):
        assert math.isfinite(record[key]), key


UNREAD = ("changes nothing while grpo.off_policy_correction.name is {}; set name: {}, or leave {} at {}")
TIS = "tis to cap each weight at it"
MASK = "mask to drop the tokens whose ratio leaves [low, high]"


def _digits_config(tmp_path: Path, recipe: str, extra: str = "") -> Path:
    """A train.yaml of `recipe` on the digits task with a tiny policy, `extra` (YAML lines) after its run_dir."""
    path = tmp_path / "train.yaml"
    path.write_text(f"recipe: {recipe}\nmodel:\n  policy: {{preset: tiny}}\ndata:\n  task: {{name: digits}}\n"
                    f"run_dir: {tmp_path / 'run'}\n{extra}")
    return path


@pytest.mark.parametrize("override, lines", [
    ("--grpo.off_policy_correction={name: none, level: sequence}",
     ["grpo.off_policy_correction.level: sequence " + UNREAD.format("none", "tis or mask to weigh each completion "
                                                                    "by one ratio", "level", "token")]),
    ("--grpo.off_policy_correction={low: 0.1, high: 9}",
     ["grpo.off_policy_correction.low: 0.1 " + UNREAD.format("none", MASK, "low", 0.5),
      "grpo.off_policy_correction.high: 9 " + UNREAD.format("none", MASK, "high", 2.0)]),
    ("--grpo.off_policy_correction={name: none, cap: 5.0}",
     ["grpo.off_policy_correction.cap: 5.0 " + UNREAD.format("none", TIS, "cap", 2.0)]),
    ("--grpo.off_policy_correction={name: tis, low: 0.3}",
     ["grpo.off_policy_correction.low: 0.3 " + UNREAD.format("tis", MASK, "low", 0.5)]),
    ("--grpo.off_policy_correction={name: tis, high: 4.0}",
     ["grpo.off_policy_correction.high: 4.0 " + UNREAD.format("tis", MASK, "high", 2.0)]),
    ("--grpo.off_policy_correction={name: mask, cap: 3.0}",
     ["grpo.off_policy_correction.cap: 3.0 " + UNREAD.format("mask", TIS, "cap", 2.0)]),
    ("--grpo.overlong={penalty_factor: 2.0}",
     [("grpo.overlong.penalty_factor: 2.0 changes nothing while grpo.overlong.buffer is null; set buffer to ramp the "
       "penalty over the last `buffer` tokens, or leave penalty_factor at 1.0")]),
])
def test_option_keys_their_mode_does_not_read_are_refused(tmp_path, capsys, override, lines):
    path = _digits_config(tmp_path, "grpo")
    assert main(["validate", "--config", str(path), override]) == 2
    assert capsys.readouterr().err.splitlines() == [f"override '{override}': {line}" for line in lines]
    # the same rule in PPO's section, at the key's place in the file
    path.write_text("recipe: ppo\nmodel:\n  policy: {preset: tiny}\ndata:\n  task: {name: digits}\n"
                    f"run_dir: {tmp_path / 'run'}\nppo:\n  {override.removeprefix('--grpo.').replace('=', ': ', 1)}\n")
    assert main(["validate", "--config", str(path)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert all(e.startswith(f"{path}:8:") for e in errors), errors
    assert [e.split(": ", 1)[1] for e in errors] == [line.replace("grpo.", "ppo.") for line in lines]


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
@pytest.mark.parametrize("option", [
    "off_policy_correction: {name: tis, cap: 2.0}", "off_policy_correction: {name: mask, low: 0.5, high: 2.0}",
    "off_policy_correction: {name: tis, level: sequence}", "off_policy_correction: {name: mask, level: sequence}",
    "off_policy_correction: {name: tis, cap: 5.0, level: sequence}",
    "off_policy_correction: {name: mask, low: 0.2, high: 5.0, level: sequence}",
    "overlong: {buffer: 4, penalty_factor: 1.0}", "overlong: {buffer: 4, penalty_factor: 2.0}",
    "overlong: {mask_truncated: true}",
    # keys at their schema defaults change nothing either way, as `level: token` under `name: none`
    "off_policy_correction: {name: none, cap: 2.0, low: 0.5, high: 2.0, level: token}",
    "off_policy_correction: {name: tis, low: 0.5}", "off_policy_correction: {name: mask, cap: 2.0}",
    "overlong: {buffer: null, penalty_factor: 1.0}",
])
def test_option_combinations_the_readme_shows_validate(tmp_path, capsys, recipe, option):
    path = _digits_config(tmp_path, recipe, f"rollout:\n  max_new_tokens: 8\n{recipe}:\n  {option}\n")
    assert main(["validate", "--config", str(path)]) == 0, capsys.readouterr().err


def test_option_combinations_are_refused_at_their_keys(tmp_path, capsys):
    path = _digits_config(tmp_path, "grpo", "rollout:\n  max_new_tokens: 8\ngrpo:\n  overlong: {buffer: 9}\n"
                          "  off_policy_correction: {name: mask, low: 2.0, high: 1.5}\n")
    assert main(["validate", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"{path}:10:22: grpo.overlong.buffer: 9 exceeds rollout.max_new_tokens (8); the penalty ramps over "
         "the last `buffer` tokens a completion may have"),
        f"{path}:11:44: grpo.off_policy_correction.low: 2.0 must be below high (1.5), else every token is dropped"]
    # a level that changes nothing without a correction to apply it to
    assert main(["validate", "--config", str(path), "--grpo.off_policy_correction.name=none",
                 "--grpo.off_policy_correction.level=sequence", "--grpo.overlong.buffer=null",
                 "--grpo.off_policy_correction.low=0.5", "--grpo.off_policy_correction.high=2.0"]) == 2
    line = ("override '--grpo.off_policy_correction.level=sequence': grpo.off_policy_correction.level: sequence "
            "changes nothing while grpo.off_policy_correction.name is none; set name: tis or mask to weigh each "
            "completion by one ratio, or leave level at token")
    assert capsys.readouterr().err.splitlines() == [line]
    # a mask window without 1 in it drops the tokens on which trainer and rollout agree: nearly all of them
    for low, high, key in ((1.5, 2.0, "low"), (1.0, 2.0, "low"), (0.2, 0.9, "high"), (0.5, 1, "high")):
        assert main(["validate", "--config", str(path), "--grpo.overlong.buffer=null",
                     f"--grpo.off_policy_correction.low={low}", f"--grpo.off_policy_correction.high={high}"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            (f"override '--grpo.off_policy_correction.{key}={low if key == 'low' else high}': "
              f"grpo.off_policy_correction.{key}: [low, high] = [{low}, {high}] must hold 1, the ratio of a token on "
             "which the trainer and the rollout agree, else nearly every token is dropped (verl's low is 1 / high)")]
    assert main(["validate", "--config", str(path), "--grpo.overlong.buffer=null",
                 "--grpo.off_policy_correction.low=0.99", "--grpo.off_policy_correction.high=1.01"]) == 0
    cfg = config(tmp_path / "run", grpo={"overlong": {"buffer": 9}})   # Python configs skip validate: the recipe checks
    with pytest.raises(FwError, match="grpo.overlong.buffer: 9 exceeds rollout.max_new_tokens"):
        FwModule(cfg)


@pytest.mark.parametrize("recipe, overrides, line", [
    ("grpo", ["--grpo.kl_estimator=k1"],
     ("grpo.kl_estimator: k1 changes nothing while grpo.kl_coef is 0.0; set kl_coef > 0 to add the KL to the "
     "reference, or leave kl_estimator at k3")),
    ("ppo", ["--ppo.kl_coef=0", "--ppo.kl_estimator=k3"],
     ("ppo.kl_estimator: k3 changes nothing while ppo.kl_coef is 0; set kl_coef > 0 to add the KL to the "
     "reference, or leave kl_estimator at k1")),
])
def test_a_kl_estimator_without_a_kl_term_is_refused(tmp_path, capsys, recipe, overrides, line):
    path = _digits_config(tmp_path, recipe)
    assert main(["validate", "--config", str(path), *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [f"override '{overrides[-1]}': {line}"]
    # the estimator is read once the KL term is on, and its default stands under kl_coef 0
    assert main(["validate", "--config", str(path), *overrides, f"--{recipe}.kl_coef=0.1"]) == 0
    assert main(["validate", "--config", str(path), f"--{recipe}.kl_coef=0"]) == 0


def test_dynamic_sampling_max_rounds_without_dynamic_sampling_is_refused(tmp_path, capsys):
    path = _digits_config(tmp_path, "grpo", "grpo:\n  dynamic_sampling_max_rounds: 3\n")
    assert main(["validate", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"{path}:8:32: grpo.dynamic_sampling_max_rounds: 3 changes nothing while grpo.dynamic_sampling is false; "
         "set dynamic_sampling: true to draw further rounds, or leave dynamic_sampling_max_rounds at 10")]
    assert main(["validate", "--config", str(path), "--grpo.dynamic_sampling=true"]) == 0


def test_adv_eps_under_scale_rewards_none_is_refused(tmp_path, capsys):
    path = _digits_config(tmp_path, "grpo", "grpo:\n  scale_rewards: none\n  adv_eps: 0.01\n")
    assert main(["validate", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"{path}:9:12: grpo.adv_eps: 0.01 changes nothing while grpo.scale_rewards is none; set scale_rewards: "
         "group or batch to divide the advantages by a std, or leave adv_eps at 0.0001")]
    # Dr.GRPO's advantages are the centred rewards whatever eps is: the key is indeed unread
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25])
    for eps in (1e-4, 0.01, 10.0):
        assert torch.equal(grpo_advantages(rewards, 4, "none", eps), expected)
    assert main(["validate", "--config", str(path), "--grpo.scale_rewards=group"]) == 0


def test_a_tis_cap_below_one_is_refused(tmp_path, capsys):
    # trainer and rollout agree (ratio 1) on every token: a cap of 0.5 weights each by 0.5, capping them all
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125]]))
    mask = torch.ones(1, 3)
    c = OffPolicyCorrection("tis", cap=0.5, low=0.5, high=2.0, level="token")(logp, logp.clone(), mask)
    assert torch.allclose(c.weight, torch.full((1, 3), 0.5)) and float(c.capped_frac) == 1.0
    path = _digits_config(tmp_path, "grpo", "grpo:\n  off_policy_correction: {name: tis, cap: 0.5}\n")
    assert main(["validate", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"{path}:8:43: grpo.off_policy_correction.cap: 0.5 is below 1, the ratio of a token on which the trainer "
         "and the rollout agree, so nearly every token's weight is capped and the update is just scaled by it; "
         "set cap >= 1")]
    assert main(["validate", "--config", str(path), "--grpo.off_policy_correction.cap=1.0"]) == 0


class TruncationProbe(Callback):
    """Whether each rollout batch's completions were all cut at max_new_tokens, read at each policy step."""

    all_cut: ClassVar[list] = []

    def before_optimizer_step(self, trainer, module, optimizer):
        TruncationProbe.all_cut.append(bool(module.recipe.last_rollout.truncated.all()))


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_an_update_on_no_token_is_said_once(tmp_path, capsys, mask_truncated):
    """One new token a completion: the tiny model's rows all run to max_new_tokens, and overlong.mask_truncated leaves
    every one of them out of the loss. That update trains on nothing, which the metrics show only as a zero gradient:
    one line says so, once, the first time; without mask_truncated nothing is said."""
    TruncationProbe.all_cut.clear()
    probe = {"class_path": "test_rl_breadth.TruncationProbe"}
    fit(config(tmp_path / "run", [probe], rollout={"max_new_tokens": 1},
               grpo={"overlong": {"mask_truncated": mask_truncated}}))
    assert TruncationProbe.all_cut == [True, True]   # the premise: every batch all cut
    said = [line for line in capsys.readouterr().err.splitlines() if "fw: warning: every completion" in line]
    expected = ("fw: warning: every completion of the rollout batch after policy step 0 was cut at "
                "rollout.max_new_tokens (1), and grpo.overlong.mask_truncated leaves such completions out of the loss, "
                "so this update trains on no token; raise rollout.max_new_tokens, or set mask_truncated: false (said "
                "once)")
    assert said == ([expected] if mask_truncated else [])
