"""RL loss pieces: KL estimators, the clipped policy surrogate, the clipped value loss, aggregation.

Per-token tensors are ``[B, T]`` with a response ``mask`` (1 on completion tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recipes.advantages import masked_mean, masked_var

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    With ``l = ref_logp - logp``: k1 = -l, k2 = l^2 / 2, k3 = exp(l) - l - 1 (non-negative).
    """
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp of a huge log-ratio overflows to inf; the clamp keeps one outlier token from NaN-ing the loss
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimate: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over the mask.

    - ``token-mean``: sum over all masked tokens / number of masked tokens;
    - ``seq-mean-token-mean``: each sequence's token mean, then the mean over sequences;
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): each sequence's token sum / ``max_len``, then the mean
      over sequences (``max_len`` defaults to T).
    """
    m = mask.to(per_token.dtype)
    masked = per_token * m
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=1) / m.sum(dim=1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum-norm":
        norm = per_token.shape[1] if max_len is None else max_len
        return (masked.sum(dim=1) / norm).mean()
    raise ValueError(f"aggregate: mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def aggregate_weight(mask: Tensor, full_mask: Tensor, mode: str, full_tokens: float | None = None) -> float:
    """Share of a micro-batch (``mask``) in its minibatch (``full_mask``) under ``mode``.

    ``sum(aggregate(micro) * aggregate_weight(micro))`` over a minibatch's micro-batches equals
    ``aggregate(minibatch)``, so gradient accumulation reproduces the un-split loss exactly.

    With several processes (DDP averages gradients over ranks) pass ``full_tokens``, the minibatch's
    token count averaged over ranks (``global tokens / world size``): token-mean is then the exact
    mean over the tokens of every rank's minibatch, however unevenly the ranks' completions ran. The
    sequence-mean modes need nothing: every rank holds the same number of sequences.
    """
    if mode == "token-mean":
        total = float(full_mask.sum()) if full_tokens is None else float(full_tokens)
        return float(mask.sum()) / total if total > 0 else 0.0
    if mode in LOSS_AGG_MODES:
        return mask.shape[0] / full_mask.shape[0]
    raise ValueError(f"aggregate_weight: mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


@dataclass
class PolicyLoss:
    """Clipped surrogate loss and its diagnostics (all scalars; only ``loss`` carries a gradient)."""

    loss: Tensor          # aggregated -min(rho*A, clip(rho)*A)
    clip_frac: Tensor     # share of tokens whose clipped term was the active (gradient-free) one
    approx_kl: Tensor     # k3 estimate of KL(pi_old || pi_theta): mean(rho - 1 - log rho)
    ratio_mean: Tensor    # mean importance ratio over the mask
    adv_weighted: Tensor  # aggregated rho*A (unclipped objective); -loss is the clipped one


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps_low: float,
                clip_eps_high: float, loss_agg: str, max_len: int | None = None) -> PolicyLoss:
    """PPO/GRPO clipped surrogate: per token ``-min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A)``.

    ``rho = exp(logp - old_logp)``; ``advantages`` is ``[B, T]`` (per token) or ``[B]`` (per sequence,
    broadcast over its tokens).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, loss_agg, max_len)
    with torch.no_grad():
        mf = mask.to(torch.float32)
        clip_frac = masked_mean((clipped < unclipped).to(torch.float32), mf)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, mf)
        ratio_mean = masked_mean(ratio, mf)
        adv_weighted = aggregate(unclipped, mask, loss_agg, max_len)
    return PolicyLoss(loss, clip_frac, approx_kl, ratio_mean, adv_weighted)


@dataclass
class ValueLoss:
    """Clipped value loss and its diagnostics."""

    loss: Tensor       # aggregated 0.5 * max((V-R)^2, (clip(V, V_old +- c) - R)^2)
    clip_frac: Tensor  # share of tokens where the clipped error was the larger one
    error: Tensor      # mean squared error (V - R)^2 over the mask


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
               loss_agg: str = "token-mean", max_len: int | None = None) -> ValueLoss:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``."""
    old = old_values.detach()
    ret = returns.detach()
    v_clipped = old + torch.clamp(values - old, -clip, clip)
    err = (values - ret).square()
    err_clipped = (v_clipped - ret).square()
    per_token = 0.5 * torch.maximum(err, err_clipped)
    loss = aggregate(per_token, mask, loss_agg, max_len)
    with torch.no_grad():
        mf = mask.to(torch.float32)
        clip_frac = masked_mean((err_clipped > err).to(torch.float32), mf)
        error = masked_mean(err.detach(), mf)
    return ValueLoss(loss, clip_frac, error)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over the mask (population variances); NaN when Var(R) is 0."""
    v = values.detach().to(torch.float32)
    r = returns.detach().to(torch.float32)
    var_r = masked_var(r, mask)
    if float(var_r) == 0.0:
        return torch.tensor(float("nan"))
    return 1.0 - masked_var(r - v, mask) / var_r
