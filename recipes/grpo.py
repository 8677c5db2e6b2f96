"""GRPO: group-relative policy optimisation with a clipped surrogate (manual optimization).

One Lightning training step = one rollout batch: ``rollout.prompts_per_step`` prompts, ``grpo.group_size``
completions each, scored; group advantages; then ``grpo.epochs`` x ``grpo.minibatches`` policy
optimizer steps (each minibatch split into ``trainer.accumulate_grad_batches`` micro-batches whose
gradients accumulate). The rollout's behaviour logprobs are pi_old: there is no second old-policy
forward. ``trainer.max_steps`` counts policy optimizer steps; the last rollout stops updating once
it is reached, and a run resumed from there with a larger ``max_steps`` trains that batch's remaining steps
first (recipes/rl.py: the cut batch).

About the first update's loss: the ratio is 1, so the surrogate is ``-A`` averaged as ``loss_agg`` weighs
tokens: ~0 under seq-mean-token-mean (group advantages are centred), but under the token-weighted modes it
follows how length goes with reward. The gradient is not 0 either way. The logged
``policy/adv_abs`` (mean |A|) and ``grad_norm`` show the signal, and ``policy/objective``
is the advantage-weighted ratio the update climbs.

With several processes each rank samples its own prompts (see recipes/rl.py for the data position);
groups never straddle ranks, so ``group`` and ``none`` need no communication. ``scale_rewards: batch``
divides by the std of the global batch (every rank's rewards, one all-reduce of count, sum and sum of
squares), token-mean divides by the minibatch's token count over all ranks, so 2 processes x P prompts
compute the advantages and the update of 1 process holding both ranks' rollouts.

Options (all off by default): ``grpo.dynamic_sampling`` drops groups whose rewards are all equal and
draws further rounds of prompts until ``rollout.prompts_per_step`` informative groups are collected on
every rank (every rank draws the same number of rounds: one all-reduce per round); ``grpo.overlong``
shapes the rewards and masks truncated completions; ``grpo.off_policy_correction`` and
``grpo.clip_ratio_c`` change the loss (recipes/losses.py). The reward metrics describe every drawn
sample, the loss metrics the trained batch.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from framework.errors import FwError
from framework.recipe import Requirements, StepContext
from recipes.advantages import all_reduce_sum, batch_reward_std, grpo_advantages, overlong_shaping, tied_groups
from recipes.losses import aggregate, build_policy_loss, kl_estimate, option_problems
from recipes.rl import MicroBatch, Phase, RLRecipe, ScoredRollout


class GRPORecipe(RLRecipe):
    """GRPO over a task's prompts with a verifiable reward; see the module docstring."""

    section = "grpo"
    samples_key = "group_size"

    @classmethod
    def scores_whole_batch(cls, cfg: dict) -> bool:
        # the reference's logprobs of every row, and the trainer's for a correction, before the update
        g = cfg["grpo"]
        return g["kl_coef"] > 0 or g["off_policy_correction"]["name"] != "none"

    @classmethod
    def requirements(cls, cfg: dict) -> Requirements:
        return Requirements(automatic_optimization=False, reference_model=cfg["grpo"]["kl_coef"] > 0)

    @classmethod
    def config_problems(cls, cfg: dict) -> list[str]:
        return option_problems("grpo", cfg["grpo"], cfg["rollout"]["max_new_tokens"])

    def __init__(self, cfg: dict, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self._check_batch_split(cfg["rollout"]["prompts_per_step"] * cfg["grpo"]["group_size"])
        problems = self.config_problems(cfg)
        if problems:
            raise FwError(problems[0])
        self.policy_loss = build_policy_loss(cfg["grpo"], cfg["rollout"]["max_new_tokens"])
        self.last_advantages: Tensor | None = None   # [B] of the latest rollout, for callbacks and tests

    def draw(self, ctx: StepContext) -> tuple[ScoredRollout, Tensor, int]:
        """This step's rollout rounds as one batch, its shaped rewards and the number of rounds: one round,
        or under dynamic sampling rounds until every rank holds ``rollout.prompts_per_step`` groups whose
        rewards differ, or ``dynamic_sampling_max_rounds`` rounds are spent."""
        g = self.cfg["grpo"]
        wanted = self.cfg["rollout"]["prompts_per_step"]
        rounds: list[ScoredRollout] = []
        shaped: list[Tensor] = []
        informative = 0
        while True:
            ro = self.collect(ctx, g["group_size"], round_index=len(rounds))
            rewards, metrics = overlong_shaping(g, ro.rewards, ro.completion_lens, ro.truncated,
                                                self.cfg["rollout"]["max_new_tokens"])
            for name, value in metrics.items():
                ctx.log(name, value, weight=ro.rewards.numel())
            rounds.append(ro)
            shaped.append(rewards)
            if not g["dynamic_sampling"] or len(rounds) >= g["dynamic_sampling_max_rounds"]:
                break
            informative += int((~tied_groups(rewards, g["group_size"])).sum())
            # every rank draws until every rank is done: the rounds advance the shared data position
            short = torch.tensor(float(max(wanted - informative, 0)), dtype=torch.float64, device=ctx.device)
            if float(all_reduce_sum(short)) == 0:
                break
        return concat_rollouts(rounds, self.tokenizer.pad_id or 0), torch.cat(shaped), len(rounds)

    def new_batch(self, ctx: StepContext) -> tuple[dict[str, Any], int]:
        """A new rollout batch drawn, scored and logged, with what its update reads pinned (``RLRecipe.pin``), and
        the number of rollout rounds drawn."""
        g = self.cfg["grpo"]
        size, wanted = g["group_size"], self.cfg["rollout"]["prompts_per_step"]
        drawn, rewards, rounds = self.draw(ctx)
        self.log_rollout(ctx, drawn)
        data = drawn
        if g["dynamic_sampling"]:
            groups = informative_groups(rewards, size, wanted)
            rows = (groups[:, None] * size + torch.arange(size, device=groups.device)).reshape(-1)
            data, rewards = select_rows(drawn, rows), rewards[rows.to(rewards.device)]
            ctx.log("rollout/rounds", rounds)
            ctx.log("rollout/groups_drawn", rounds * ctx.world_size * wanted)
        # groups trained on with advantage 0: the share dynamic sampling would replace
        ctx.log("rollout/uninformative_frac", tied_groups(rewards, size).float().mean())
        batch_std = batch_reward_std(rewards) if g["scale_rewards"] == "batch" else None
        adv = grpo_advantages(rewards, size, g["scale_rewards"], g["adv_eps"], batch_std)

        def trainer_logprobs() -> Tensor:
            return self.scored_logprobs(ctx.policy, data)

        inputs, train = self.loss_batch(ctx, g, data, trainer_logprobs)
        ctx.log("policy/adv_abs", _token_weighted_abs_mean(adv, train.mask))
        return self.pin(data, inputs, advantages=adv, ref_logp=None), rounds

    def training_step(self, ctx: StepContext, batch: Any, batch_idx: int) -> None:
        g = self.cfg["grpo"]
        cut = self.resume_cut(ctx)
        pinned, rounds = self.new_batch(ctx) if cut is None else (cut.pinned, 0)
        data = self.last_rollout = pinned["rollout"]
        adv = self.last_advantages = pinned["advantages"]
        inputs, train = self.pinned_loss(pinned)
        if g["kl_coef"] > 0 and pinned["ref_logp"] is None:
            # the frozen reference's logprobs: once a batch (a continued batch's when it began without a KL term)
            pinned["ref_logp"] = self.scored_logprobs(ctx.reference, data)
        ref_logp = pinned["ref_logp"] if g["kl_coef"] > 0 else None

        def policy_micro(mb: MicroBatch, first: bool) -> tuple[Tensor, dict[str, Tensor]]:
            rows = mb.rows
            mask = train.mask[rows]
            logp, entropy = self.logprobs(ctx.policy, data, mb, with_entropy=first)
            weight = None if inputs.weight is None else inputs.weight[rows]
            pl = self.policy_loss(logp, inputs.old_logp[rows], adv[rows], mask, weight)
            loss = pl.loss
            logged = {"surrogate": pl.loss, "objective": pl.adv_weighted, "clip_frac": pl.clip_frac,
                      "approx_kl": pl.approx_kl, "ratio": pl.ratio_mean}
            if g["clip_ratio_c"] is not None:
                logged["dual_clip_frac"] = pl.dual_clip_frac
            if ref_logp is not None:
                kl = aggregate(kl_estimate(logp, ref_logp[rows], g["kl_estimator"]), mask, g["loss_agg"],
                               self.policy_loss.max_len)
                loss = loss + g["kl_coef"] * kl
                logged["ref_kl"] = kl
            logged["loss"] = loss
            if first:   # the mismatch over every completion token, the dropped ones included
                self.log_first_update(ctx, logp, entropy, data, rows)
            return loss, logged

        self.train_batch(ctx, train, [Phase("policy", "policy", policy_micro)], pinned, cut, rounds)


def informative_groups(rewards: Tensor, group_size: int, wanted: int) -> Tensor:
    """Indices of the ``wanted`` groups dynamic sampling trains on, in draw order: the first groups whose
    rewards differ, then, when too few do, the first tied ones to fill the batch."""
    tied = tied_groups(rewards, group_size)
    order = torch.cat([(~tied).nonzero().flatten(), tied.nonzero().flatten()])
    return order[:wanted].sort().values


def concat_rollouts(parts: list[ScoredRollout], pad_id: int) -> ScoredRollout:
    """Rollout rounds as one batch, each padded (tokens with ``pad_id``, logprobs and mask with 0) to
    the widest."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.tokens.shape[1] for p in parts)
    cwidth = max(p.mask.shape[1] for p in parts)

    def cat(name: str, to: int | None = None, value: float = 0) -> Tensor:
        tensors = [getattr(p, name) for p in parts]
        if to is not None:
            tensors = [torch.nn.functional.pad(t, (0, to - t.shape[1]), value=value) for t in tensors]
        return torch.cat(tensors)

    n = [p.rewards.numel() for p in parts]
    return ScoredRollout(
        tokens=cat("tokens", width, pad_id), prompt_lens=cat("prompt_lens"), completion_lens=cat("completion_lens"),
        old_logp=cat("old_logp", cwidth), mask=cat("mask", cwidth), rewards=cat("rewards"), correct=cat("correct"),
        n_reward_errors=sum(p.n_reward_errors for p in parts),
        eos_frac=sum(p.eos_frac * k for p, k in zip(parts, n)) / sum(n), truncated=cat("truncated"),
        gen_seconds=sum(p.gen_seconds for p in parts), texts=[t for p in parts for t in p.texts])


def select_rows(data: ScoredRollout, rows: Tensor) -> ScoredRollout:
    """The rollout's ``rows`` (a 1-D index) as a batch of their own; the generation time stays the batch's."""
    idx = rows.to(data.tokens.device)
    truncated = data.truncated[idx]
    return ScoredRollout(
        tokens=data.tokens[idx], prompt_lens=data.prompt_lens[idx], completion_lens=data.completion_lens[idx],
        old_logp=data.old_logp[idx], mask=data.mask[idx], rewards=data.rewards[idx], correct=data.correct[idx],
        n_reward_errors=data.n_reward_errors, eos_frac=float((~truncated).float().mean()), truncated=truncated,
        gen_seconds=data.gen_seconds, texts=[data.texts[i] for i in rows.tolist()])


def _token_weighted_abs_mean(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Mean |A| over response tokens of per-sequence advantages (what token-mean weighs)."""
    tokens = mask.sum(dim=1)
    return (seq_adv.abs() * tokens).sum() / tokens.sum().clamp(min=1)
