"""GRPO advantages, GAE and whitening against hand-computed / independent float64 references."""
import math

import pytest
import torch

from recipes.advantages import gae, grpo_advantages, whiten


def test_grpo_group_scaling_hand_computed():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # group 2: rewards 1, 1, 1, 1 -> all advantages 0 (std 0, eps keeps it finite)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = grpo_advantages(r, group_size=4, scale_rewards="group", eps=1e-4)
    s = math.sqrt(1.0 / 3.0) + 1e-4
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 0.0, 0.0]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)


def test_grpo_batch_and_none_scaling_hand_computed():
    r = torch.tensor([3.0, 1.0, 0.0, 0.0])  # groups of 2: means 2 and 0
    none = grpo_advantages(r, 2, "none", 1e-4)
    assert none.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    # batch std (unbiased) of [3, 1, 0, 0]: mean 1, squares 4+0+1+1 = 6, /3 = 2
    batch = grpo_advantages(r, 2, "batch", 0.0)
    s = math.sqrt(2.0)
    assert batch.tolist() == pytest.approx([1 / s, -1 / s, 0.0, 0.0], abs=1e-6)


def test_grpo_bad_input():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.zeros(4), 3, "group", 1e-4)


def _gae_reference(rewards, values, lengths, gamma, lam):
    """Plain-Python float64 GAE over each row's first `length` tokens (terminal after the last)."""
    adv_rows, ret_rows = [], []
    for r, v, n in zip(rewards, values, lengths):
        adv = [0.0] * len(r)
        running = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_v - v[t]
            running = delta + gamma * lam * running
            adv[t] = running
        adv_rows.append(adv)
        ret_rows.append([adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return adv_rows, ret_rows


def test_gae_hand_computed_single_row():
    # gamma 1, lam 1: A_t = sum_{k>=t} r_k - V_t ; r = [0, 0, 1], V = [0.5, 0.25, 0.75]
    r = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    v = torch.tensor([[0.5, 0.25, 0.75, 9.0]])  # column 3 is padding: must not leak in
    m = torch.tensor([[1, 1, 1, 0]])
    a, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    assert a[0].tolist() == pytest.approx([0.5, 0.75, 0.25, 0.0])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0])
    # gamma 0.9, lam 0.5 by hand:
    # d2 = 1 - .75 = .25 ; d1 = 0 + .9*.75 - .25 = .425 ; d0 = 0 + .9*.25 - .5 = -.275
    # A2 = .25 ; A1 = .425 + .45*.25 = .5375 ; A0 = -.275 + .45*.5375 = -0.033125
    a, ret = gae(r, v, m, gamma=0.9, lam=0.5)
    assert a[0].tolist() == pytest.approx([-0.033125, 0.5375, 0.25, 0.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.466875, 0.7875, 1.0, 0.0], abs=1e-6)


def test_gae_ragged_batch_vs_reference():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 7]
    r = torch.randn(4, 7, generator=g, dtype=torch.float64)
    v = torch.randn(4, 7, generator=g, dtype=torch.float64)
    m = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).long()
    ref_a, ref_r = _gae_reference(r.tolist(), v.tolist(), lengths, 0.97, 0.9)
    a, ret = gae(r, v, m, gamma=0.97, lam=0.9)
    assert torch.allclose(a.double(), torch.tensor(ref_a, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(ret.double(), torch.tensor(ref_r, dtype=torch.float64), atol=1e-5)


def test_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, -7.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # masked values 1..5: mean 3, population var 2
    w = whiten(x, m, eps=0.0)
    s = math.sqrt(2.0)
    assert w.flatten().tolist() == pytest.approx([-2 / s, -1 / s, 0.0, 0.0, 1 / s, 2 / s, 0.0, 0.0], abs=1e-6)
    w2 = whiten(x, m, eps=0.0, shift_mean=False)
    assert w2[0, :3].tolist() == pytest.approx([3 - 2 / s, 3 - 1 / s, 3.0], abs=1e-6)
