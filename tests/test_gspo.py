"""GSPO (`policy_loss: gspo`): the clipped surrogate of each completion's length-normalised likelihood ratio,
against hand-computed values, against TRL's and verl's published formulas written out here, and through `fw fit`
as a float64 gradient of the sequence-level objective."""
import copy
import math
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from test_grpo import config, hand_group_advantages, token_logprobs

from framework.callbacks import Callback
from framework.config import load_config
from framework.metrics import read_metrics
from framework.trainer import fit
from recipes.losses import POLICY_LOSSES, SequenceClippedSurrogate


def test_hand_computed_value_and_gradient():
    # row 0: log-ratios 0.1, -0.3, 0.5 -> s = e^0.1 = 1.1052 > 1.05 with A = +1: clipped, no gradient
    # row 1: log-ratios 0.02, -0.04 and a masked token -> s = e^-0.01 with A = -2: unclipped
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, -0.3, 0.5], [0.02, -0.04, 7.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    out = SequenceClippedSurrogate(0.05, 0.05, "seq-mean-token-mean")(logp, old, adv, mask)
    s1 = math.exp(-0.01)
    row0, row1 = -min(math.exp(0.1) * 1.0, 1.05 * 1.0), -(s1 * -2.0)
    assert out.loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-12)
    out.loss.backward()
    # row 1's term is 2 * s per token, averaged over its 2 tokens and the 2 rows: d/dlogp_t = 2 * s / 4
    want = [[0.0, 0.0, 0.0], [2 * s1 / 4, 2 * s1 / 4, 0.0]]
    assert torch.allclose(logp.grad, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert out.clip_frac.item() == pytest.approx(3 / 5)   # row 0's three tokens of the five
    assert out.ratio_mean.item() == pytest.approx((3 * math.exp(0.1) + 2 * s1) / 5)
    assert POLICY_LOSSES["gspo"] is SequenceClippedSurrogate


def test_approx_kl_is_the_tokens_not_the_sequence_mean():
    """policy/approx_kl estimates KL(pi_old || pi_theta) from each token's ratio, as under `clip` (and as verl's
    GSPO logs it): a completion whose tokens moved +0.3 and -0.3 has sequence ratio 1 but has moved."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.3, -0.3, 9.0], [0.1, 0.2, -0.05]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    out = SequenceClippedSurrogate(3e-4, 4e-4, "seq-mean-token-mean")(logp, old, adv, mask)
    want = sum(math.exp(x) - 1 - x for x in (0.3, -0.3, 0.1, 0.2, -0.05)) / 5
    assert out.approx_kl.item() == pytest.approx(want, rel=1e-12)
    assert out.ratio_mean.item() == pytest.approx((2 * 1.0 + 3 * math.exp(0.25 / 3)) / 5, rel=1e-12)


def test_token_advantages_clip_only_the_tokens_the_sign_makes_active():
    """With PPO's per-token advantages a completion whose ratio is past the clip is not clipped whole: the
    tokens with A > 0 (s > 1 + eps_high) lose their gradient, the one with A < 0 keeps it."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.full((1, 3), 0.01, dtype=torch.float64, requires_grad=True)   # s = e^0.01 > 1 + 4e-4
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    out = SequenceClippedSurrogate(3e-4, 4e-4, "seq-mean-token-mean")(logp, old, adv, mask)
    s = math.exp(0.01)
    assert out.loss.item() == pytest.approx(-(1.0004 - s + 2 * 1.0004) / 3, rel=1e-12)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, s / 3, 0.0], rel=1e-12)
    assert out.clip_frac.item() == pytest.approx(2 / 3)


def trl_sequence_loss(logp, old, adv, mask, eps_low, eps_high, loss_type):
    """TRL's GRPO loss with importance_sampling_level="sequence" (GSPO), written out from its published
    formula: the log-weight is the masked mean of the token log-ratios, with its gradient."""
    log_w = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_w)[:, None]
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)   # "bnpo": a token mean of the batch


@pytest.mark.parametrize("loss_agg, loss_type", [("seq-mean-token-mean", "grpo"), ("token-mean", "bnpo")])
def test_matches_trl_sequence_level_on_random_inputs(loss_agg, loss_type):
    g = torch.Generator().manual_seed(3)
    B, T = 12, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp0 = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.02
    mask = (torch.rand(B, T, generator=g) < 0.8).to(torch.float64)
    mask[:, 0] = 1.0   # every row has a loss token (TRL's sequence mean counts a row without one, fw's does not)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    eps_low, eps_high = 3e-3, 4e-3   # a few rows clip, most do not
    logp = logp0.clone().requires_grad_(True)
    ours = SequenceClippedSurrogate(eps_low, eps_high, loss_agg)(logp, old, adv, mask).loss
    ours.backward()
    ref_logp = logp0.clone().requires_grad_(True)
    ref = trl_sequence_loss(ref_logp, old, adv, mask, eps_low, eps_high, loss_type)
    ref.backward()
    s = torch.exp(((logp0 - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
    clipped = ((s < 1 - eps_low) & (adv < 0)) | ((s > 1 + eps_high) & (adv > 0))
    assert 0 < int(clipped.sum()) < B - 1   # both branches on
    assert ours.item() == pytest.approx(ref.item(), abs=1e-14)
    assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-14)


def verl_gspo_loss(logp, old, adv, mask, eps_low, eps_high):
    """verl's compute_policy_loss_gspo, written out: the token form s_t = sg(s) * pi_t / sg(pi_t) with
    per-token advantages, the pessimistic max of the two losses, seq-mean-token-mean."""
    seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10.0)
    ratio = torch.exp(log_ratio)
    losses = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    return ((losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def test_matches_verl_token_form_with_token_advantages():
    """PPO's advantages are per token: each token's loss uses its own advantage with its sequence's ratio."""
    g = torch.Generator().manual_seed(5)
    B, T = 10, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp0 = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.01
    mask = (torch.rand(B, T, generator=g) < 0.85).to(torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = logp0.clone().requires_grad_(True)
    ours = SequenceClippedSurrogate(2e-3, 3e-3, "seq-mean-token-mean")(logp, old, adv, mask)
    ours.loss.backward()
    ref_logp = logp0.clone().requires_grad_(True)
    ref = verl_gspo_loss(ref_logp, old, adv, mask, 2e-3, 3e-3)
    ref.backward()
    assert 0 < ours.clip_frac.item() < 1
    assert ours.loss.item() == pytest.approx(ref.item(), abs=1e-14)
    assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-14)


class GspoProbe(Callback):
    """At policy step 2 (the second epoch on one rollout, so ratios differ from 1), recomputes the GRPO loss of the
    sequence-level GSPO objective in float64: per completion -min(s A, clip(s) A), s = exp(mean of its token
    log-ratios), a mean over completions; and compares the gradients."""

    results: ClassVar[list] = []

    def before_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy" or module.policy_version != 1:
            return
        g, data = module.cfg["grpo"], module.recipe.last_rollout
        policy = copy.deepcopy(module.policy).double()
        lp = token_logprobs(policy, data, module.cfg["rollout"]["temperature"])
        adv = hand_group_advantages(data.rewards.double().tolist(), g["group_size"], g["adv_eps"])
        terms, clipped = [], 0
        for b, tokens in enumerate(lp):
            s = torch.exp(sum(t - float(data.old_logp[b, j]) for j, t in enumerate(tokens)) / len(tokens))
            low, high = 1 - g["clip_eps_low"], 1 + g["clip_eps_high"]
            terms.append(-torch.minimum(s * adv[b], s.clamp(low, high) * adv[b]))
            s_value = float(s.detach())
            clipped += int(s_value * adv[b] > min(max(s_value, low), high) * adv[b])
        loss = sum(terms) / len(terms)
        loss.backward()
        got = dict(module.policy.named_parameters())
        worst = max(float((p.grad - got[n].grad.double()).abs().max() / p.grad.abs().max().clamp(min=1e-12))
                    for n, p in policy.named_parameters())
        GspoProbe.results.append({"worst_rel": worst, "clipped": clipped, "rows": len(terms)})


def test_gspo_through_fit_matches_the_sequence_objective_in_float64(tmp_path):
    GspoProbe.results = []
    cfg = config(tmp_path / "run", [{"class_path": "test_gspo.GspoProbe"}],
                 reward={"name": None, "class_path": "test_grpo.LetterReward"},
                 grpo={"group_size": 4, "epochs": 2, "policy_loss": "gspo", "clip_eps_low": 3e-3,
                       "clip_eps_high": 4e-3, "loss_agg": "seq-mean-token-mean"},
                 trainer={"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False,
                          "accumulate_grad_batches": 2})
    fit(cfg)
    [result] = GspoProbe.results
    assert 0 < result["clipped"] < result["rows"]   # both branches on
    assert result["worst_rel"] < 1e-4
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert 0 < record["policy/clip_frac"] < 1


def test_ppo_trains_with_gspo(tmp_path):
    cfg = load_config([str(Path(__file__).resolve().parents[1] / "recipes" / "ppo.yaml")],
                      [f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=2", "--ppo.policy_loss=gspo",
                       "--ppo.clip_eps_low=3e-4", "--ppo.clip_eps_high=4e-4", "--trainer.enable_progress_bar=false",
                       "--logging.tensorboard=false"])
    fit(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "policy/loss" in r][-1] == 2
    assert all(math.isfinite(r["policy/loss"]) for r in records if "policy/loss" in r)
