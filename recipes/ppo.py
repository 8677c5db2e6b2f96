"""PPO with a learned critic (manual optimization, two optimizers: policy and critic).

One Lightning training step = one rollout batch: ``rollout.prompts_per_step`` prompts x
``ppo.samples_per_prompt`` completions. Token rewards are ``-kl_coef * KL(k1|k3)`` against the
reference on every response token plus the sequence reward at the last one, folded in before GAE;
advantages and returns come from GAE(gamma, lam) with the critic's pre-update values, once per
rollout, and stay pinned for every replayed epoch (optionally whitened). Each minibatch takes one
policy optimizer step (clipped surrogate) and one critic step (clipped value loss x ``vf_coef``, clipped to
``ppo.critic.max_grad_norm``; the critic's own AdamW is blind to the scale but for that clip).
``trainer.max_steps`` counts policy steps only: the module steps the critic's optimizer without advancing
Lightning's global step. A batch that ``max_steps`` stops inside keeps its pinned advantages, old values and
returns for a resumed run (recipes/rl.py: the cut batch).

With several processes (DDP) the whitening uses the mean and variance of every rank's tokens in the loss
and token-mean losses divide by the minibatch's token count over all ranks (recipes/rl.py).

Options (all off by default): ``ppo.overlong`` adds DAPO's soft length penalty to the sequence reward
before GAE and can drop truncated completions from both losses; ``ppo.off_policy_correction`` and
``ppo.clip_ratio_c`` change the policy loss (recipes/losses.py). Rows and tokens a correction or the
overlong mask drops leave the critic's loss and the whitening's statistics too: one loss mask weighs both
phases' micro-batches and is the set the advantages are whitened over (0 outside it).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from framework.errors import FwError
from framework.recipe import POLICY, OptimizerRole, Requirements, StepContext
from recipes.advantages import gae, masked_mean, overlong_shaping, whiten
from recipes.losses import (
    ClippedValueLoss,
    build_policy_loss,
    explained_variance,
    kl_estimate,
    option_problems,
)
from recipes.rl import MicroBatch, Phase, RLRecipe

CRITIC = OptimizerRole("critic", "value", ("ppo", "critic"))


class PPORecipe(RLRecipe):
    """PPO over a task's prompts with a verifiable reward and a value model; see the module docstring."""

    section = "ppo"
    samples_key = "samples_per_prompt"

    @classmethod
    def scores_whole_batch(cls, cfg: dict) -> bool:
        return True   # the critic's old values of every row (and, with a KL, both models' logprobs)

    @classmethod
    def requirements(cls, cfg: dict) -> Requirements:
        return Requirements(
            automatic_optimization=False, optimizers=(POLICY, CRITIC), value_model=True,
            reference_model=cfg["ppo"]["kl_coef"] > 0,
            # the policy and the critic losses are backpropagated separately: each leaves the other
            # model's parameters without gradients
            find_unused_parameters=True,
            unsupported_precisions={"16-mixed": "the critic steps outside Lightning's loss scaler; use bf16-mixed"})

    @classmethod
    def config_problems(cls, cfg: dict) -> list[str]:
        return option_problems("ppo", cfg["ppo"], cfg["rollout"]["max_new_tokens"])

    def __init__(self, cfg: dict, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self._check_batch_split(cfg["rollout"]["prompts_per_step"] * cfg["ppo"]["samples_per_prompt"])
        max_len = cfg["rollout"]["max_new_tokens"]
        problems = self.config_problems(cfg)
        if problems:
            raise FwError(problems[0])
        self.policy_loss = build_policy_loss(cfg["ppo"], max_len)
        self.value_loss = ClippedValueLoss.from_section(cfg["ppo"], max_len)
        self.last_advantages_raw: Tensor | None = None   # [B, Tc] GAE advantages of the latest rollout
        self.last_advantages: Tensor | None = None       # the same, whitened when whiten_advantages

    def new_batch(self, ctx: StepContext) -> dict[str, Any]:
        """A new rollout batch drawn, scored, valued and logged, with what its update reads pinned
        (``RLRecipe.pin``): advantages (whitened when set), the critic's old values and the returns."""
        p = self.cfg["ppo"]
        data = self.collect(ctx, p["samples_per_prompt"])
        n_seq = data.mask.shape[0]
        everything = torch.arange(n_seq, device=data.mask.device)
        with torch.no_grad():
            old_values = self.values(ctx.value, data)
            token_rewards = torch.zeros_like(data.mask)
            kl_metric, logp = None, None
            if p["kl_coef"] > 0:
                # Both sides through the trainer's forward: the rollout's logprobs come from the KV-cache
                # decode path (bf16 cache under autocast), whose mismatch would make KL(pi || pi) != 0.
                logp = self.scored_logprobs(ctx.policy, data)
                ref_logp = self.scored_logprobs(ctx.reference, data)
                kl = kl_estimate(logp, ref_logp, p["kl_estimator"]) * data.mask
                token_rewards -= p["kl_coef"] * kl
                kl_metric = float(masked_mean(kl, data.mask))
            rewards, shaping_metrics = overlong_shaping(p, data.rewards, data.completion_lens, data.truncated,
                                                        self.cfg["rollout"]["max_new_tokens"])
            last = (data.completion_lens - 1).clamp(min=0)
            has_tokens = data.completion_lens > 0
            token_rewards[everything[has_tokens], last[has_tokens]] += rewards[has_tokens]
            advantages, returns = gae(token_rewards, old_values, data.mask, p["gamma"], p["lam"])
        self.log_rollout(ctx, data)
        for name, value in shaping_metrics.items():
            ctx.log(name, value, weight=n_seq)

        def trainer_logprobs() -> Tensor:
            if logp is not None:   # the KL's forward above: the same policy, before any update
                return logp
            return self.scored_logprobs(ctx.policy, data)

        inputs, train = self.loss_batch(ctx, p, data, trainer_logprobs)
        raw = advantages
        if p["whiten_advantages"]:
            # over the tokens the loss keeps (train.mask), of every rank's batch: a completion the overlong mask or
            # the correction drops moves neither the mean nor the variance the kept tokens are whitened with
            with torch.no_grad():
                advantages = whiten(advantages, train.mask, across_ranks=True)
        ev = explained_variance(old_values, returns, data.mask)
        # Undefined (NaN) when every return is equal (e.g. all rewards 0 and no KL): logged with weight 0,
        # never skipped, because every rank must log the same metrics (they are reduced collectively).
        undefined = bool(torch.isnan(ev))
        ctx.log("value/explained_variance", 0.0 if undefined else ev, weight=0.0 if undefined else None)
        ctx.log("value/mean", masked_mean(old_values, data.mask))
        ctx.log("value/returns", masked_mean(returns, data.mask))
        ctx.log("policy/adv_abs", masked_mean(advantages.abs(), train.mask))   # what the loss weighs
        if kl_metric is not None:
            ctx.log("policy/ref_kl", kl_metric)
        return self.pin(data, inputs, advantages=advantages, advantages_raw=raw, old_values=old_values,
                        returns=returns)

    def training_step(self, ctx: StepContext, batch: Any, batch_idx: int) -> None:
        p = self.cfg["ppo"]
        cut = self.resume_cut(ctx)
        pinned = self.new_batch(ctx) if cut is None else cut.pinned
        data = self.last_rollout = pinned["rollout"]
        advantages = self.last_advantages = pinned["advantages"]
        self.last_advantages_raw = pinned["advantages_raw"]
        old_values, returns = pinned["old_values"], pinned["returns"]
        inputs, train = self.pinned_loss(pinned)

        def policy_micro(mb: MicroBatch, first: bool) -> tuple[Tensor, dict[str, Tensor]]:
            rows = mb.rows
            logp, entropy = self.logprobs(ctx.policy, data, mb, with_entropy=first)
            weight = None if inputs.weight is None else inputs.weight[rows]
            pl = self.policy_loss(logp, inputs.old_logp[rows], advantages[rows], train.mask[rows], weight)
            if first:   # the mismatch over every completion token, the dropped ones included
                self.log_first_update(ctx, logp, entropy, data, rows)
            logged = {"loss": pl.loss, "objective": pl.adv_weighted, "clip_frac": pl.clip_frac,
                      "approx_kl": pl.approx_kl, "ratio": pl.ratio_mean}
            if p["clip_ratio_c"] is not None:
                logged["dual_clip_frac"] = pl.dual_clip_frac
            return pl.loss, logged

        def critic_micro(mb: MicroBatch, first: bool) -> tuple[Tensor, dict[str, Tensor]]:
            rows = mb.rows
            values = self.values(ctx.value, data, mb)
            vl = self.value_loss(values, old_values[rows], returns[rows], train.mask[rows])
            return p["vf_coef"] * vl.loss, {"loss": vl.loss, "clip_frac": vl.clip_frac, "error": vl.error}

        self.train_batch(ctx, train, [Phase("policy", "policy", policy_micro), Phase("critic", "value", critic_micro)],
                         pinned, cut)
