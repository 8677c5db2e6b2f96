"""PPO with a learned critic (manual optimization, two optimizers: policy and critic).

One Lightning training step = one rollout batch: ``rollout.prompts_per_step`` prompts x
``ppo.samples_per_prompt`` completions. Token rewards are ``-kl_coef * KL(k1|k3)`` against the
reference on every response token plus the sequence reward at the last one, folded in before GAE;
advantages and returns come from GAE(gamma, lam) with the critic's pre-update values, once per
rollout, and stay pinned for every replayed epoch (optionally whitened). Each minibatch takes one
policy optimizer step (clipped surrogate) and one critic step (clipped value loss x ``vf_coef``,
clipped to ``ppo.critic.max_grad_norm``). ``trainer.max_steps`` counts policy steps only: the
module steps the critic's optimizer without advancing Lightning's global step.

With several processes (DDP) the whitening uses the mean and variance of every rank's response tokens
and token-mean losses divide by the minibatch's token count over all ranks (recipes/rl.py).
"""
from __future__ import annotations

from typing import Any

import torch

from recipes.advantages import gae, masked_mean, whiten
from recipes.losses import aggregate_weight, explained_variance, kl_estimate, policy_loss, value_loss
from recipes.rl import RLRecipe, completion_values


class PPORecipe(RLRecipe):
    """PPO over a task's prompts with a verifiable reward and a value model; see the module docstring."""

    section = "ppo"

    def __init__(self, cfg: dict, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self._check_batch_split(cfg["rollout"]["prompts_per_step"] * cfg["ppo"]["samples_per_prompt"])
        self.last_advantages_raw: torch.Tensor | None = None   # [B, Tc] GAE advantages of the latest rollout
        self.last_advantages: torch.Tensor | None = None       # the same, whitened when whiten_advantages

    def needs_value_model(self) -> bool:
        return True

    def training_step(self, module: Any, batch: Any, batch_idx: int) -> None:
        p, cfg = self.cfg["ppo"], self.cfg
        data = self.last_rollout = self.collect(module, p["samples_per_prompt"])
        n_seq, width = data.mask.shape
        max_len = cfg["rollout"]["max_new_tokens"]
        everything = torch.arange(n_seq, device=data.mask.device)
        with torch.no_grad():
            old_values = completion_values(module.value, data.tokens, data.prompt_lens, data.completion_lens, width)
            token_rewards = torch.zeros_like(data.mask)
            kl_metric = None
            if p["kl_coef"] > 0:
                # Both sides through the trainer's forward: the rollout's logprobs come from the KV-cache
                # decode path (bf16 cache under autocast), whose mismatch would make KL(pi || pi) != 0.
                logp, _ = self.logprobs(module.policy, data, everything)
                ref_logp, _ = self.logprobs(module.reference, data, everything)
                kl = kl_estimate(logp, ref_logp, p["kl_estimator"]) * data.mask
                token_rewards -= p["kl_coef"] * kl
                kl_metric = float(masked_mean(kl, data.mask))
            last = (data.completion_lens - 1).clamp(min=0)
            has_tokens = data.completion_lens > 0
            token_rewards[everything[has_tokens], last[has_tokens]] += data.rewards[has_tokens]
            advantages, returns = gae(token_rewards, old_values, data.mask, p["gamma"], p["lam"])
            self.last_advantages_raw = advantages
            if p["whiten_advantages"]:   # over the tokens of every rank's batch
                advantages = whiten(advantages, data.mask, across_ranks=True)
            self.last_advantages = advantages
        self.log_rollout(module, data)
        ev = explained_variance(old_values, returns, data.mask)
        # Undefined (NaN) when every return is equal (e.g. all rewards 0 and no KL): logged with weight 0,
        # never skipped, because every rank must log the same metrics (they are reduced collectively).
        undefined = bool(torch.isnan(ev))
        module.log_metric("value/explained_variance", 0.0 if undefined else ev, weight=0.0 if undefined else None)
        module.log_metric("value/mean", masked_mean(old_values, data.mask))
        module.log_metric("value/returns", masked_mean(returns, data.mask))
        module.log_metric("policy/adv_abs", masked_mean(advantages.abs(), data.mask))
        if kl_metric is not None:
            module.log_metric("policy/ref_kl", kl_metric)
        policy_opt, critic_opt = module.optimizers()
        for epoch in range(p["epochs"]):
            for mb_index, micro_batches in enumerate(self.minibatches(n_seq, epoch)):
                if not self.steps_left(module):
                    break
                first_update = epoch == 0 and mb_index == 0
                micro_batches = [rows.to(data.mask.device) for rows in micro_batches]
                mb_mask = data.mask[torch.cat(micro_batches)]
                mb_tokens = self.minibatch_tokens(module, mb_mask, p["loss_agg"])
                for rows in micro_batches:
                    mask = data.mask[rows]
                    logp, entropy = self.logprobs(module.policy, data, rows, with_entropy=first_update)
                    pl = policy_loss(logp, data.old_logp[rows], advantages[rows], mask, p["clip_eps_low"],
                                     p["clip_eps_high"], p["loss_agg"], max_len)
                    weight = aggregate_weight(mask, mb_mask, p["loss_agg"], mb_tokens)
                    module.manual_backward(pl.loss * weight)
                    self.log_weighted(module, "policy", {
                        "loss": pl.loss, "objective": pl.adv_weighted, "clip_frac": pl.clip_frac,
                        "approx_kl": pl.approx_kl, "ratio": pl.ratio_mean}, weight)
                    if first_update:
                        self.log_first_update(module, logp, entropy, data, rows)
                module.step_optimizer(policy_opt, cfg["optimizer"]["max_grad_norm"])
                for rows in micro_batches:
                    mask = data.mask[rows]
                    values = completion_values(module.value, data.tokens[rows], data.prompt_lens[rows],
                                               data.completion_lens[rows], width)
                    vl = value_loss(values, old_values[rows], returns[rows], mask, p["value_clip"],
                                    p["loss_agg"], max_len)
                    weight = aggregate_weight(mask, mb_mask, p["loss_agg"], mb_tokens)
                    module.manual_backward(p["vf_coef"] * vl.loss * weight)
                    self.log_weighted(module, "value", {"loss": vl.loss, "clip_frac": vl.clip_frac,
                                                        "error": vl.error}, weight)
                module.step_optimizer(critic_opt, p["critic"]["max_grad_norm"])
        self.finish_rollout(module)
        module.log_metric("policy_version", module.policy_version, reduce="last")
