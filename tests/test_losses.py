"""KL estimators, the clipped surrogate, the value loss, aggregation and explained variance
against hand-computed values and independent float64 computations."""
import json
import math
from pathlib import Path

import pytest
import torch

from recipes.losses import (
    POLICY_LOSSES,
    ClippedSurrogate,
    ClippedValueLoss,
    aggregate,
    aggregate_weight,
    aggregate_weights,
    build_policy_loss,
    explained_variance,
    kl_estimate,
    minibatch_count,
)


def test_kl_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])  # l = ref - logp = [-0.5, 1.0, 0.0]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5, 0.0])
    k3 = [math.exp(-0.5) + 0.5 - 1.0, math.e - 1.0 - 1.0, 0.0]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(k3, abs=1e-6)


def test_k3_keeps_its_gradient_where_the_policy_drifted_far_above_the_reference():
    """k3 = e^l - l - 1 with l = log pi_ref - log pi, so d k3 / d log pi = 1 - e^l: about 1 for a token the policy
    has raised far above the reference (l = -30), the pull back that a KL penalty is for; the value is 29. Above
    l = 20 the estimator is capped (e^l overflows float32 near 89), and stays finite."""
    logp = torch.tensor([-0.25, -1.0, -5.0, -100.25], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-30.25, -1.0, -7.0, -0.25], dtype=torch.float64)   # l = -30, 0, -2, 100
    k3 = kl_estimate(logp, ref, "k3")
    k3.sum().backward()
    assert k3[:3].tolist() == pytest.approx([29.0, 0.0, math.exp(-2.0) + 1.0], rel=1e-6)
    assert logp.grad[:3].tolist() == pytest.approx([1.0 - math.exp(-30.0), 0.0, 1.0 - math.exp(-2.0)], rel=1e-6)
    assert math.isfinite(k3[3].item()) and k3[3].item() == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


def test_kl_estimators_are_unbiased_or_biased_as_documented():
    # exact KL(p || q) of two categoricals vs the Monte-Carlo mean of k1 and k3 under samples of p
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    logp, logq = p.log(), q.log()
    # expectation under p, computed exactly as a weighted sum over the support
    k1 = float((p * kl_estimate(logp, logq, "k1")).sum())
    k3 = float((p * kl_estimate(logp, logq, "k3")).sum())
    assert k1 == pytest.approx(exact, rel=1e-9)
    assert k3 == pytest.approx(exact, rel=1e-9)


def test_aggregate_modes_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert float(aggregate(x, m, "token-mean")) == pytest.approx((1 + 2 + 3 + 10) / 4)
    assert float(aggregate(x, m, "seq-mean-token-mean")) == pytest.approx((2.0 + 10.0) / 2)
    assert float(aggregate(x, m, "seq-mean-token-sum-norm", max_len=8)) == pytest.approx((6 / 8 + 10 / 8) / 2)
    assert float(aggregate(x, m, "seq-mean-token-sum-norm")) == pytest.approx((6 / 4 + 10 / 4) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_weight_splits_exactly(mode):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.3).long()
    whole = aggregate(x, m, mode, max_len=7)
    parts = sum(aggregate(x[i:i + 2], m[i:i + 2], mode, max_len=7) * aggregate_weight(m[i:i + 2], m, mode)
                for i in range(0, 6, 2))
    assert float(parts) == pytest.approx(float(whole), abs=1e-6)


def test_seq_mean_leaves_out_completions_dropped_from_the_loss_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 0.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])   # the last completion dropped (mask_truncated, say)
    assert float(aggregate(x, m, "seq-mean-token-mean")) == pytest.approx((2.0 + 10.0) / 2)
    assert float(aggregate(x, m, "token-mean")) == pytest.approx((1 + 2 + 3 + 10) / 4)
    # Dr.GRPO's denominator is a constant: the dropped completion still counts in it
    assert float(aggregate(x, m, "seq-mean-token-sum-norm", max_len=4)) == pytest.approx((6 / 4 + 10 / 4) / 3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert float(aggregate(x, torch.zeros_like(m), mode)) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_weight_splits_exactly_with_dropped_completions(mode):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.3).long()
    m[1] = 0        # one completion of the first micro-batch dropped
    m[4:] = 0       # the whole last micro-batch dropped
    whole = aggregate(x, m, mode, max_len=7)
    weights = aggregate_weights([m[i:i + 2] for i in range(0, 6, 2)], m, mode)
    parts = sum(aggregate(x[i:i + 2], m[i:i + 2], mode, max_len=7) * w for i, w in zip(range(0, 6, 2), weights))
    assert float(parts) == pytest.approx(float(whole), abs=1e-6)
    assert weights[2] == (1 / 3 if mode == "seq-mean-token-sum-norm" else 0.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ranks_weighted_by_the_count_over_ranks_give_the_one_process_loss(mode):
    """What DDP computes (each rank's micro-batches weighted by RLRecipe.full_count, the gradients averaged over
    the ranks) equals the loss of one process holding both ranks' minibatches, however unevenly the ranks'
    completions were dropped."""
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(4, 5, generator=g) for _ in range(2)]
    m = [(torch.rand(4, 5, generator=g) > 0.2).long() for _ in range(2)]
    m[0][3] = 0      # rank 0 drops one completion, rank 1 three
    m[1][:3] = 0
    full_count = float(sum(minibatch_count(r, mode) for r in m)) / 2   # all-reduce sum / world size
    ranks = []
    for xr, mr in zip(x, m):
        weights = aggregate_weights([mr[:2], mr[2:]], mr, mode, full_count)
        ranks.append(sum(aggregate(xr[i:i + 2], mr[i:i + 2], mode) * w for i, w in zip((0, 2), weights)))
    one_process = aggregate(torch.cat(x), torch.cat(m), mode)
    assert float(sum(ranks) / 2) == pytest.approx(float(one_process), abs=1e-6)


def test_policy_loss_hand_computed():
    # one sequence, 4 tokens; ratios e^logdiff; eps_low 0.2, eps_high 0.3
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 1.0, 3.0]])
    m = torch.ones(1, 4)
    out = ClippedSurrogate(clip_eps_low=0.2, clip_eps_high=0.3, loss_agg="token-mean")(logp, old, adv, m)
    # token 0: rho 1.5 > 1.3, A>0 -> min(1.5, 1.3) = 1.3 (clipped)
    # token 1: rho 0.5 < 0.8, A<0 -> min(-1.0, -1.6) = -1.6 (clipped)
    # token 2: rho 1.1, A>0 -> 1.1 ; token 3: rho 0.7, A>0 -> min(2.1, 2.4) = 2.1 (unclipped)
    assert float(out.loss.detach()) == pytest.approx(-(1.3 - 1.6 + 1.1 + 2.1) / 4, abs=1e-6)
    assert float(out.clip_frac) == pytest.approx(0.5)
    assert float(out.ratio_mean) == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4, abs=1e-6)
    assert float(out.adv_weighted) == pytest.approx((1.5 - 1.0 + 1.1 + 2.1) / 4, abs=1e-6)
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)) / 4
    assert float(out.approx_kl) == pytest.approx(kl, abs=1e-6)
    out.loss.backward()
    # d/dlogp of -rho*A/4 where unclipped, 0 where clipped
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1 / 4, -0.7 * 3 / 4], abs=1e-6)


def test_policy_loss_sequence_advantages_broadcast_and_ratio_one():
    # ratio 1 (first GRPO iteration): loss = -aggregate(A) which is ~0 for balanced advantages,
    # but the gradient is not: d loss / d logp_t = -A_t / n_tokens
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    m = torch.tensor([[1, 1, 1], [1, 1, 1]])
    out = ClippedSurrogate(0.2, 0.2, "token-mean")(logp, logp.detach(), adv, m)
    assert float(out.loss.detach()) == pytest.approx(0.0)
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1 / 6] * 3 + [1 / 6] * 3)
    assert float(out.clip_frac) == 0.0 and float(out.approx_kl) == 0.0


def test_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.1, 2.0]])
    ret = torch.tensor([[0.0, 1.0, 3.0]])
    m = torch.ones(1, 3)
    loss_fn = ClippedValueLoss(clip=0.2, loss_agg="token-mean")
    out = loss_fn(v, old, ret, m)
    # t0: err 1.0, clipped V = 0.7 -> 0.49 ; max 1.0
    # t1: err 1.0, clipped V = max(0.0, -0.1) = 0.0 -> 1.0 ; max 1.0 (not strictly larger)
    # t2: err 1.0, clipped V = 2.0 -> 1.0
    assert float(out.loss.detach()) == pytest.approx(0.5 * (1.0 + 1.0 + 1.0) / 3)
    assert float(out.clip_frac) == 0.0
    v2 = torch.tensor([[0.0]])
    out2 = loss_fn(v2, torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    # err 0, clipped V = 0.8 -> 0.64: the clipped term wins
    assert float(out2.loss) == pytest.approx(0.5 * 0.64, abs=1e-6)
    assert float(out2.clip_frac) == 1.0 and float(out2.error) == 0.0


def test_explained_variance_float64_reference():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(3, 6, generator=g, dtype=torch.float64)
    v = r + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    m = torch.ones(3, 6)
    m[1, 4:] = 0
    sel = m.bool()
    rr, vv = r[sel], v[sel]
    expected = 1 - ((rr - vv).var(unbiased=False) / rr.var(unbiased=False)).item()
    assert float(explained_variance(v, r, m)) == pytest.approx(expected, abs=1e-5)
    assert float(explained_variance(r, r, m)) == pytest.approx(1.0)
    assert math.isnan(float(explained_variance(v, torch.ones(3, 6), m)))


def test_policy_loss_is_built_once_from_its_section():
    section = {"policy_loss": "clip", "clip_eps_low": 0.1, "clip_eps_high": 0.28, "loss_agg": "seq-mean-token-mean",
               "clip_ratio_c": 3.0}
    assert build_policy_loss(section, 64) == ClippedSurrogate(0.1, 0.28, "seq-mean-token-mean", 64, 3.0)
    schema = json.loads((Path(__file__).parents[1] / "schemas" / "train.schema.json").read_text())
    for recipe in ("grpo", "ppo"):   # every name the schema offers has a class, and nothing else is offered
        assert schema["properties"][recipe]["properties"]["policy_loss"]["enum"] == sorted(POLICY_LOSSES)
