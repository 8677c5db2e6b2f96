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

from recipes.advantages import batch_reward_std, grpo_advantages
from recipes.losses import aggregate, aggregate_weight, kl_estimate, policy_loss
from recipes.rl import RLRecipe


class GRPORecipe(RLRecipe):
    """GRPO over a task's prompts with a verifiable reward; see the module docstring."""

    section = "grpo"

    def __init__(self, cfg: dict, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self._check_batch_split(cfg["rollout"]["prompts_per_step"] * cfg["grpo"]["group_size"])
        self.last_advantages: Tensor | None = None   # [B] of the latest rollout, for callbacks and tests

    def training_step(self, module: Any, batch: Any, batch_idx: int) -> None:
        g, cfg = self.cfg["grpo"], self.cfg
        data = self.last_rollout = self.collect(module, g["group_size"])
        batch_std = batch_reward_std(data.rewards) if g["scale_rewards"] == "batch" else None
        adv = self.last_advantages = grpo_advantages(data.rewards, g["group_size"], g["scale_rewards"],
                                                     g["adv_eps"], batch_std)
        self.log_rollout(module, data)
        module.log_metric("policy/adv_abs", _token_weighted_abs_mean(adv, data.mask))
        max_len = cfg["rollout"]["max_new_tokens"]
        use_kl = g["kl_coef"] > 0
        ref_logp = None
        if use_kl:
            with torch.no_grad():
                ref_logp, _ = self.logprobs(module.reference, data, torch.arange(len(adv), device=adv.device))
        opt = module.optimizers()
        for epoch in range(g["epochs"]):
            for mb_index, micro_batches in enumerate(self.minibatches(len(adv), epoch)):
                if not self.steps_left(module):
                    break
                first_update = epoch == 0 and mb_index == 0
                mb_mask = data.mask[torch.cat(micro_batches).to(adv.device)]
                mb_tokens = self.minibatch_tokens(module, mb_mask, g["loss_agg"])
                for rows in micro_batches:
                    rows = rows.to(adv.device)
                    mask = data.mask[rows]
                    logp, entropy = self.logprobs(module.policy, data, rows, with_entropy=first_update)
                    pl = policy_loss(logp, data.old_logp[rows], adv[rows], mask, g["clip_eps_low"],
                                     g["clip_eps_high"], g["loss_agg"], max_len)
                    loss = pl.loss
                    logged = {"surrogate": pl.loss, "objective": pl.adv_weighted, "clip_frac": pl.clip_frac,
                              "approx_kl": pl.approx_kl, "ratio": pl.ratio_mean}
                    if use_kl:
                        kl = aggregate(kl_estimate(logp, ref_logp[rows], g["kl_estimator"]), mask,
                                       g["loss_agg"], max_len)
                        loss = loss + g["kl_coef"] * kl
                        logged["ref_kl"] = kl
                    logged["loss"] = loss
                    weight = aggregate_weight(mask, mb_mask, g["loss_agg"], mb_tokens)
                    module.manual_backward(loss * weight)
                    self.log_weighted(module, "policy", logged, weight)
                    if first_update:
                        self.log_first_update(module, logp, entropy, data, rows)
                module.step_optimizer(opt, cfg["optimizer"]["max_grad_norm"])
        self.finish_rollout(module)
        module.log_metric("policy_version", module.policy_version, reduce="last")


def _token_weighted_abs_mean(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Mean |A| over response tokens of per-sequence advantages (what token-mean weighs)."""
    tokens = mask.sum(dim=1)
    return (seq_adv.abs() * tokens).sum() / tokens.sum().clamp(min=1)
