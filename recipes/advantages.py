"""Advantage estimators for the RL recipes: GRPO group advantages, GAE, masked whitening.

Tensors follow the rollout layout: ``[B, Tc]`` aligned to completion tokens, with a response mask
that is 1 on real completion tokens and 0 on padding past each row's end.
"""
from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, group_size: int, scale_rewards: str, eps: float,
                    batch_std: Tensor | float | None = None) -> Tensor:
    """Per-sample GRPO advantages (float32) for ``rewards`` [B] laid out as consecutive groups of ``group_size``.

    ``A_i = (r_i - mean_group) / (std + eps)`` where std is the group's std (``group``), the whole
    batch's std (``batch``) or no scaling at all (``none``, Dr.GRPO: ``A_i = r_i - mean_group``).
    The std is the unbiased sample std (Bessel-corrected, as torch.std and TRL use).
    ``batch_std`` replaces the std of ``rewards`` under ``batch``: with several processes it is the std
    of the global batch (``batch_reward_std``), of which ``rewards`` is one rank's share.

    The group statistics are float64, and a tied group (every reward equal) gets exactly 0 whatever
    ``eps`` is: a float mean of equal numbers need not equal them, and 0 / (0 + eps) is no signal either.
    """
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"grpo_advantages: {rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.to(torch.float64).view(-1, group_size)
    tied = tied_groups(rewards, group_size)[:, None].expand_as(grouped).reshape(-1)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "none":
        return centred.masked_fill(tied, 0.0).to(torch.float32)
    if scale_rewards == "group":
        if group_size < 2:
            raise ValueError("grpo_advantages: scale_rewards 'group' needs group_size >= 2 for a group std")
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    elif batch_std is not None:
        std = torch.as_tensor(batch_std, dtype=torch.float64, device=rewards.device)
    else:
        if rewards.numel() < 2:
            raise ValueError("grpo_advantages: scale_rewards 'batch' needs at least 2 rewards for a std")
        std = grouped.reshape(-1).std()
    return (centred / (std + eps)).masked_fill(tied, 0.0).to(torch.float32)


def tied_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[B / group_size] bool: the groups whose rewards are all equal (no advantage signal)."""
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def overlong_penalty(completion_lens: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment (float32 [B], <= 0): 0 up to ``max_len - buffer`` tokens, then
    falling linearly to ``-factor`` at ``max_len``: ``-factor * max(0, len - (max_len - buffer)) / buffer``."""
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong_penalty: buffer {buffer} must be in [1, max_len = {max_len}]")
    excess = (completion_lens.to(torch.float64) - (max_len - buffer)).clamp(min=0.0)
    return (-factor * excess / buffer).to(torch.float32)


def overlong_shaping(section: dict, rewards: Tensor, completion_lens: Tensor, truncated: Tensor,
                     max_len: int) -> tuple[Tensor, dict[str, Tensor]]:
    """The rewards a recipe section's ``overlong`` settings train on, and their metrics (empty when off):
    ``rollout/truncated_frac`` and, with a ``buffer``, the soft penalty added and its mean."""
    o = section["overlong"]
    metrics: dict[str, Tensor] = {}
    if o["mask_truncated"] or o["buffer"] is not None:
        metrics["rollout/truncated_frac"] = truncated.float().mean()
    if o["buffer"] is None:
        return rewards, metrics
    penalty = overlong_penalty(completion_lens, max_len, o["buffer"], o["penalty_factor"]).to(rewards.device)
    metrics["reward/overlong_penalty_mean"] = penalty.mean()
    return rewards + penalty, metrics


def batch_reward_std(rewards: Tensor) -> Tensor:
    """Unbiased std (float64 scalar) of the rewards of every rank together, from one all-reduce of
    (count, sum, sum of squares) when torch.distributed is initialised; ``rewards.std()`` otherwise."""
    r = rewards.detach().to(torch.float64).reshape(-1)
    stats = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device), r.sum(),
                         r.square().sum()])
    stats = all_reduce_sum(stats)
    n, total, squares = stats.unbind()
    if float(n) < 2:
        raise ValueError("batch_reward_std: needs at least 2 rewards for a std")
    mean = total / n
    return ((squares - n * mean * mean).clamp(min=0.0) / (n - 1)).sqrt()


def all_reduce_sum(t: Tensor) -> Tensor:
    """The sum of ``t`` over all processes (a new tensor) when torch.distributed is initialised, else ``t``.

    Collective: every rank must call it with the same shape, in the same order.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the response mask; returns ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    running backwards; the state after a row's last token is terminal (its next value is masked out).
    ``returns = A + V``. Both outputs are 0 outside the mask. Computed in float32, no gradient.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError(
            "gae: token_rewards, values and mask must share one [B, T] shape, got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    with torch.no_grad():
        m = mask.to(torch.float32)
        r = token_rewards.to(torch.float32) * m
        v = values.detach().to(torch.float32) * m
        steps = r.shape[1]
        advantages = torch.zeros_like(r)
        next_adv = torch.zeros_like(r[:, 0])
        next_value = torch.zeros_like(r[:, 0])
        for t in reversed(range(steps)):
            delta = r[:, t] + gamma * next_value - v[:, t]
            next_adv = (delta + gamma * lam * next_adv) * m[:, t]
            advantages[:, t] = next_adv
            next_value = v[:, t]  # already masked: 0 past the row's end
        returns = (advantages + v) * m
    return advantages, returns


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance of ``x`` over the mask."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True,
           across_ranks: bool = False) -> Tensor:
    """Normalise ``x`` to zero mean and unit (population) variance over the mask; 0 outside it.

    With ``shift_mean=False`` only the scale changes (the mean is added back). With ``across_ranks``
    and several processes, the mean and variance are those of every rank's masked values together
    (one all-reduce of count, sum and sum of squares in float64); on one process nothing changes.
    """
    mean, var = masked_mean(x, mask), None
    if across_ranks:
        m = mask.to(torch.float64)
        xd = x.detach().to(torch.float64)
        stats = torch.stack([m.sum(), (xd * m).sum(), (xd * xd * m).sum()])
        reduced = all_reduce_sum(stats)
        if reduced is not stats:   # several processes
            n, total, squares = reduced.unbind()
            n = n.clamp(min=1)
            mean_d = total / n
            mean = mean_d.to(x.dtype)
            var = ((squares / n) - mean_d * mean_d).clamp(min=0).to(x.dtype)
    if var is None:
        var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)
