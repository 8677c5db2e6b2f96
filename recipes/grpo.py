"""GRPO: group-relative policy optimisation with a clipped surrogate (manual optimization).

One Lightning training step = one rollout batch: ``rollout.prompts_per_step`` prompts, ``grpo.group_size``
completions each, scored; group advantages; then ``grpo.epochs`` x ``grpo.minibatches`` policy
optimizer steps (each minibatch split into ``trainer.accumulate_grad_batches`` micro-batches whose
gradients accumulate). The rollout's behaviour logprobs are pi_old: there is no second old-policy
forward. ``trainer.max_steps`` counts policy optimizer steps; the last rollout stops updating once
it is reached.

About "loss is 0": on the first update of a rollout the ratio is 1, so the surrogate equals
``-mean(A)``, which is ~0 because group advantages are centred; the gradient is not 0. The logged
``policy/adv_abs`` (mean |A|) and ``grad_norm`` show the signal, and ``policy/objective``
is the advantage-weighted ratio the update climbs.

With several processes each rank samples its own prompts (see recipes/rl.py for the data position);
groups never straddle ranks, so ``group`` and ``none`` need no communication. ``scale_rewards: batch``
divides by the std of the global batch (every rank's rewards, one all-reduce of count, sum and sum of
squares), token-mean divides by the minibatch's token count over all ranks, so 2 processes x P prompts
compute the advantages and the update of 1 process holding both ranks' rollouts.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from framework.recipe import Requirements, StepContext
from recipes.advantages import batch_reward_std, grpo_advantages
from recipes.losses import aggregate, build_policy_loss, kl_estimate
from recipes.rl import Phase, RLRecipe


class GRPORecipe(RLRecipe):
    """GRPO over a task's prompts with a verifiable reward; see the module docstring."""

    section = "grpo"
    samples_key = "group_size"

    @classmethod
    def scores_whole_batch(cls, cfg: dict) -> bool:
        return cfg["grpo"]["kl_coef"] > 0   # the reference's logprobs of every row, before the update

    @classmethod
    def requirements(cls, cfg: dict) -> Requirements:
        return Requirements(automatic_optimization=False, reference_model=cfg["grpo"]["kl_coef"] > 0)

    def __init__(self, cfg: dict, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self._check_batch_split(cfg["rollout"]["prompts_per_step"] * cfg["grpo"]["group_size"])
        self.policy_loss = build_policy_loss(cfg["grpo"], cfg["rollout"]["max_new_tokens"])
        self.last_advantages: Tensor | None = None   # [B] of the latest rollout, for callbacks and tests

    def training_step(self, ctx: StepContext, batch: Any, batch_idx: int) -> None:
        g = self.cfg["grpo"]
        data = self.last_rollout = self.collect(ctx, g["group_size"])
        batch_std = batch_reward_std(data.rewards) if g["scale_rewards"] == "batch" else None
        adv = self.last_advantages = grpo_advantages(data.rewards, g["group_size"], g["scale_rewards"],
                                                     g["adv_eps"], batch_std)
        self.log_rollout(ctx, data)
        ctx.log("policy/adv_abs", _token_weighted_abs_mean(adv, data.mask))
        ref_logp = None
        if g["kl_coef"] > 0:
            with torch.no_grad():
                ref_logp, _ = self.logprobs(ctx.reference, data, torch.arange(len(adv), device=adv.device))

        def policy_micro(rows: Tensor, first: bool) -> tuple[Tensor, dict[str, Tensor]]:
            mask = data.mask[rows]
            logp, entropy = self.logprobs(ctx.policy, data, rows, with_entropy=first)
            pl = self.policy_loss(logp, data.old_logp[rows], adv[rows], mask)
            loss = pl.loss
            logged = {"surrogate": pl.loss, "objective": pl.adv_weighted, "clip_frac": pl.clip_frac,
                      "approx_kl": pl.approx_kl, "ratio": pl.ratio_mean}
            if ref_logp is not None:
                kl = aggregate(kl_estimate(logp, ref_logp[rows], g["kl_estimator"]), mask, g["loss_agg"],
                               self.policy_loss.max_len)
                loss = loss + g["kl_coef"] * kl
                logged["ref_kl"] = kl
            logged["loss"] = loss
            if first:
                self.log_first_update(ctx, logp, entropy, data, rows)
            return loss, logged

        self.update(ctx, data, [Phase("policy", "policy", policy_micro)])
        self.finish_rollout(ctx)


def _token_weighted_abs_mean(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Mean |A| over response tokens of per-sequence advantages (what token-mean weighs)."""
    tokens = mask.sum(dim=1)
    return (seq_adv.abs() * tokens).sum() / tokens.sum().clamp(min=1)
