"""RL loss pieces: KL estimators, aggregation, and the policy and value losses as objects built once from
their config section (``POLICY_LOSSES`` maps ``policy_loss`` names to classes).

Per-token tensors are ``[B, T]`` with a response ``mask`` (1 on completion tokens).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from framework.config import defaults
from recipes.advantages import masked_mean, masked_var


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (``grpo.kl_estimator``).

    With ``l = ref_logp - logp``: k1 = -l, k2 = l^2 / 2, k3 = exp(l) - l - 1 (non-negative).
    """
    return KL_ESTIMATORS[estimator](ref_logp - logp)


def _k3(log_ratio: Tensor) -> Tensor:
    # l is capped at 20 (k3 = e^20 - 21 there, no gradient past it) so that the penalty of a token the policy has
    # pushed far below the reference, and its gradient, stay finite, as verl clamps it. Below, exp(l) only
    # vanishes and k3 = -l - 1 stays finite: no floor, whose clamp would stop the gradient (1 - e^l) on exactly the
    # tokens the policy has pushed furthest above the reference
    log_ratio = log_ratio.clamp(max=20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda log_ratio: -log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio.square(),
    "k3": _k3,
}


def _token_mean(masked: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return masked.sum() / m.sum().clamp(min=1)


def _seq_mean_token_mean(masked: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    lengths = m.sum(dim=1)
    return (masked.sum(dim=1) / lengths.clamp(min=1)).sum() / (lengths > 0).sum().clamp(min=1)


def _seq_mean_token_sum_norm(masked: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return (masked.sum(dim=1) / (masked.shape[1] if max_len is None else max_len)).mean()


# ``loss_agg`` modes: a per-token loss times its mask -> a scalar.
AGGREGATIONS = {"token-mean": _token_mean, "seq-mean-token-mean": _seq_mean_token_mean,
                "seq-mean-token-sum-norm": _seq_mean_token_sum_norm}


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over the mask.

    - ``token-mean``: sum over all masked tokens / number of masked tokens;
    - ``seq-mean-token-mean``: each sequence's token mean, then the mean over the sequences with a token
      in the mask (a completion dropped from the loss is not one of them);
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): each sequence's token sum / ``max_len``, then the mean
      over all sequences, dropped ones included: Dr.GRPO's denominator is a constant (``max_len``
      defaults to T).
    """
    m = mask.to(per_token.dtype)
    return AGGREGATIONS[mode](per_token * m, m, max_len)


def aggregate_weight(mask: Tensor, full_mask: Tensor, mode: str, full_count: float | None = None) -> float:
    """Share of a micro-batch (``mask``) in its minibatch (``full_mask``) under ``mode``.

    ``sum(aggregate(micro) * aggregate_weight(micro))`` over a minibatch's micro-batches equals
    ``aggregate(minibatch)``, so gradient accumulation reproduces the un-split loss exactly.

    With several processes (DDP averages gradients over ranks) pass ``full_count``, what the minibatch's
    loss divides by, averaged over ranks (``minibatch_count``: token-mean's tokens, seq-mean-token-mean's
    completions with a token in the mask, over all ranks / world size): the loss is then the exact mean
    over every rank's minibatch, however unevenly the ranks' completions ran or were dropped.
    seq-mean-token-sum-norm needs nothing: every rank holds the same number of sequences.
    """
    return aggregate_weights([mask], full_mask, mode, full_count)[0]


def minibatch_count(mask: Tensor, mode: str) -> Tensor | None:
    """What ``mode`` divides a minibatch's (or micro-batch's) loss by, as a float64 scalar on ``mask``'s
    device: token-mean its tokens, seq-mean-token-mean its completions with a token in the mask; None for
    seq-mean-token-sum-norm, which divides by its rows."""
    if mode == "token-mean":
        return mask.sum().to(torch.float64)
    if mode == "seq-mean-token-mean":
        return (mask.sum(dim=1) > 0).sum().to(torch.float64)
    return None


def aggregate_weights(masks: list[Tensor], full_mask: Tensor, mode: str,
                      full_count: float | None = None) -> list[float]:
    """``aggregate_weight`` of each micro-batch mask of one minibatch, read from the device at once
    (token-mean and seq-mean-token-mean: one sync for all of them; seq-mean-token-sum-norm: none)."""
    full = minibatch_count(full_mask, mode)
    if full is None:
        return [m.shape[0] / full_mask.shape[0] for m in masks]
    counts = torch.stack([minibatch_count(m, mode) for m in masks] + [full]).tolist()
    total = counts[-1] if full_count is None else float(full_count)
    return [c / total if total > 0 else 0.0 for c in counts[:-1]]


@dataclass
class PolicyLoss:
    """Clipped surrogate loss and its diagnostics (all scalars; only ``loss`` carries a gradient)."""

    loss: Tensor          # aggregated -min(rho*A, clip(rho)*A) (dual-clipped, IS-weighted when set)
    clip_frac: Tensor     # share of tokens whose clipped term was the active (gradient-free) one
    approx_kl: Tensor     # k3 estimate of KL(pi_old || pi_theta): mean(r - 1 - log r), r each token's pi / pi_old
    ratio_mean: Tensor    # mean importance ratio over the mask
    adv_weighted: Tensor  # aggregated rho*A (unclipped objective); -loss is the clipped one
    dual_clip_frac: Tensor  # share of tokens (A < 0) whose loss the dual clip bounded at -clip_ratio_c*A


@dataclass(frozen=True)
class ClippedSurrogate:
    """PPO/GRPO clipped surrogate (``policy_loss: clip``): per token
    ``-min(rho*A, clip(rho, 1-clip_eps_low, 1+clip_eps_high)*A)`` with ``rho = exp(logp - old_logp)``.

    With ``clip_ratio_c`` (dual clip) a token with ``A < 0`` loses at most ``-clip_ratio_c * A``, so a
    ratio far above 1 cannot make its loss unbounded. An optional per-token ``weight`` (the off-policy
    correction's IS weight, no gradient) multiplies each token's loss after both clips.
    """

    clip_eps_low: float
    clip_eps_high: float
    loss_agg: str
    max_len: int | None = None
    clip_ratio_c: float | None = None

    @classmethod
    def from_section(cls, section: dict, max_len: int) -> ClippedSurrogate:
        return cls(section["clip_eps_low"], section["clip_eps_high"], section["loss_agg"], max_len,
                   section["clip_ratio_c"])

    def log_ratio(self, logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
        """``[B, T]`` log of each token's importance ratio ``rho``."""
        return logp - old_logp.detach()

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                 weight: Tensor | None = None) -> PolicyLoss:
        """``advantages`` is ``[B, T]`` (per token) or ``[B]`` (per sequence, broadcast over its tokens)."""
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logp)
        log_ratio = self.log_ratio(logp, old_logp, mask)
        ratio = torch.exp(log_ratio)
        adv = advantages.detach()
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        dual = torch.zeros_like(per_token, dtype=torch.bool)
        if self.clip_ratio_c is not None:
            bound = -self.clip_ratio_c * adv
            dual = (adv < 0) & (per_token > bound)
            per_token = torch.where(dual, bound, per_token)
        if weight is not None:
            per_token = per_token * weight.detach()
        loss = aggregate(per_token, mask, self.loss_agg, self.max_len)
        with torch.no_grad():
            mf = mask.to(torch.float32)
            clip_frac = masked_mean((clipped < unclipped).to(torch.float32), mf)
            # each token's own ratio, whatever ratio the loss clips: GSPO's sequence mean cancels tokens that
            # moved in opposite directions and would report a policy that moved as one that stayed
            token_log_ratio = (logp - old_logp).detach()
            approx_kl = masked_mean(torch.exp(token_log_ratio) - 1.0 - token_log_ratio, mf)
            ratio_mean = masked_mean(ratio, mf)
            adv_weighted = aggregate(unclipped, mask, self.loss_agg, self.max_len)
            dual_clip_frac = masked_mean(dual.to(torch.float32), mf)
        return PolicyLoss(loss, clip_frac, approx_kl, ratio_mean, adv_weighted, dual_clip_frac)


@dataclass(frozen=True)
class SequenceClippedSurrogate(ClippedSurrogate):
    """GSPO (``policy_loss: gspo``): the clipped surrogate of each sequence's importance ratio
    ``s = exp(mean of logp - old_logp over its loss tokens)``, the length-normalised likelihood ratio, in its
    token form: every token's ratio has the value ``s`` and the gradient of ``s * exp(logp - sg(logp))``, so
    that per-token advantages (PPO's) apply too. With one advantage a sequence (GRPO's) a sequence is clipped
    whole; with PPO's the clip stops only the tokens whose advantage's sign makes it active. Sequence ratios
    stay near 1, so GSPO clips narrowly (its paper: ``clip_eps_low`` 3e-4, ``clip_eps_high`` 4e-4) and
    averages per sequence (``loss_agg: seq-mean-token-mean``); the dual clip and the off-policy weight act per
    token as under ``clip``.
    ``ratio_mean`` and ``clip_frac`` describe the sequence ratios, ``approx_kl`` the tokens' (as under ``clip``).
    """

    def log_ratio(self, logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
        m = mask.to(logp.dtype)
        token = (logp - old_logp).detach() * m
        mean = token.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        return mean + (logp - logp.detach())


class PolicyLossFn(Protocol):
    """What a policy loss is: built once from its section, then called per micro-batch."""

    max_len: int | None

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                 weight: Tensor | None = None) -> PolicyLoss: ...


# ``grpo.policy_loss`` / ``ppo.policy_loss``: a loss class with ``from_section(section, max_len)``.
POLICY_LOSSES = {"clip": ClippedSurrogate, "gspo": SequenceClippedSurrogate}


def build_policy_loss(section: dict, max_len: int) -> PolicyLossFn:
    """The policy loss a recipe section (``grpo:`` or ``ppo:``) selects, configured from it."""
    return POLICY_LOSSES[section["policy_loss"]].from_section(section, max_len)


# exp of a sequence's summed log-ratio overflows quickly; any bound a config can set lies well inside this
LOG_RATIO_BOUND = 20.0


@dataclass
class Correction:
    """The off-policy correction of one rollout batch (no gradient)."""

    weight: Tensor       # [B, T] IS weight of each token's loss, 0 outside ``mask``
    mask: Tensor         # [B, T] the loss mask: the given mask less the rejected tokens
    ratio_mean: Tensor   # mean trainer/behaviour ratio over the given mask (before capping)
    capped_frac: Tensor  # share of the given mask's tokens whose weight the cap lowered (tis)
    masked_frac: Tensor  # share of the given mask's tokens rejected (mask)


@dataclass(frozen=True)
class OffPolicyCorrection:
    """Importance weights for the rollout-vs-trainer mismatch (``off_policy_correction``).

    The ratio is ``pi_trainer / pi_behaviour`` of each sampled token (``level: token``) or of the whole
    completion (``sequence``: the product over its tokens, every token of the row sharing it); its
    log is bounded to +-``LOG_RATIO_BOUND`` before ``exp``.

    - ``tis``: truncated importance sampling, weight ``min(ratio, cap)``; nothing is rejected.
    - ``mask``: masked importance sampling, tokens (or rows) with a ratio outside ``[low, high]`` leave
      the loss mask (numerator and denominator); the kept ones are weighted by their ratio.
    - ``none``: no correction.
    """

    name: str
    cap: float
    low: float
    high: float
    level: str

    @classmethod
    def from_section(cls, section: dict) -> OffPolicyCorrection:
        c = section["off_policy_correction"]
        return cls(c["name"], c["cap"], c["low"], c["high"], c["level"])

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def __call__(self, trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Correction:
        with torch.no_grad():
            m = mask.to(torch.float32)
            log_ratio = (trainer_logp.detach().float() - behaviour_logp.float()) * m
            if self.level == "sequence":
                log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(m)
            ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
            zero = torch.zeros((), device=m.device)
            if self.name == "tis":
                capped = ratio > self.cap
                return Correction(torch.clamp(ratio, max=self.cap) * m, m, masked_mean(ratio, m),
                                  masked_mean(capped.float(), m), zero)
            if self.name == "mask":
                keep = ((ratio >= self.low) & (ratio <= self.high)).float()
                return Correction(ratio * m * keep, m * keep, masked_mean(ratio, m), zero,
                                  masked_mean(1.0 - keep, m))
            raise ValueError(f"OffPolicyCorrection: no correction named {self.name!r}")


@dataclass
class LossInputs:
    """What the policy loss of one rollout batch trains on, after overlong masking and the correction."""

    old_logp: Tensor             # [B, T] pi_old: the behaviour logprobs, or the trainer's under a correction
    mask: Tensor                 # [B, T] the loss mask
    weight: Tensor | None        # [B, T] IS weights, or None without a correction
    metrics: dict[str, Tensor]   # name -> scalar, for the recipe to log


def loss_inputs(section: dict, behaviour_logp: Tensor, mask: Tensor, truncated: Tensor,
                trainer_logprobs: Callable[[], Tensor]) -> LossInputs:
    """The loss inputs a recipe section (``grpo:`` / ``ppo:``) asks for.

    ``overlong.mask_truncated`` drops the rows cut at ``max_new_tokens`` (``truncated`` [B]) from the mask.
    With an ``off_policy_correction``, ``trainer_logprobs()`` (the trainer's no-grad logprobs of every row,
    before any update) becomes pi_old of the clipped ratio, and the IS weights correct from the
    behaviour policy to it (as verl's decoupled PPO does); without one, pi_old is the behaviour policy.
    """
    metrics: dict[str, Tensor] = {}
    m = mask.to(torch.float32)
    if section["overlong"]["mask_truncated"]:
        m = m * (~truncated.to(m.device)).to(m.dtype)[:, None]
    correction = OffPolicyCorrection.from_section(section)
    if not correction.enabled:
        return LossInputs(behaviour_logp, m, None, metrics)
    trainer_logp = trainer_logprobs().detach()
    c = correction(trainer_logp, behaviour_logp, m)
    metrics["policy/is_ratio"] = c.ratio_mean
    metrics["policy/tis_capped_frac" if correction.name == "tis" else "policy/masked_frac"] = (
        c.capped_frac if correction.name == "tis" else c.masked_frac)
    return LossInputs(trainer_logp, c.mask, c.weight, metrics)


def option_problems(name: str, section: dict, max_new_tokens: int) -> list[str]:
    """What the schema cannot check of a section's overlong and correction settings, one line each
    starting with the key (``name`` is the section's: ``grpo`` | ``ppo``)."""
    problems = []
    buffer = section["overlong"]["buffer"]
    if buffer is not None and buffer > max_new_tokens:
        problems.append(f"{name}.overlong.buffer: {buffer} exceeds rollout.max_new_tokens ({max_new_tokens}); "
                        "the penalty ramps over the last `buffer` tokens a completion may have")
    c = section["off_policy_correction"]
    if c["name"] == "mask" and not c["low"] < c["high"]:
        problems.append(f"{name}.off_policy_correction.low: {c['low']} must be below high ({c['high']}), "
                        "else every token is dropped")
    elif c["name"] == "mask" and not c["low"] < 1 < c["high"]:
        # the ratio of a token on which the trainer and the rollout agree is 1, as nearly every token's is
        key = "low" if c["low"] >= 1 else "high"
        problems.append(f"{name}.off_policy_correction.{key}: [low, high] = [{c['low']}, {c['high']}] must hold 1, "
                        "the ratio of a token on which the trainer and the rollout agree, else nearly every token is "
                        "dropped (verl's low is 1 / high)")
    if c["name"] == "tis" and c["cap"] < 1:
        # nearly every token's ratio is about 1: a cap below it weights them all by the cap, scaling the update alone
        problems.append(f"{name}.off_policy_correction.cap: {c['cap']} is below 1, the ratio of a token on which the "
                        "trainer and the rollout agree, so nearly every token's weight is capped and the update is "
                        "just scaled by it; set cap >= 1")
    problems += unread_problems(name, section)
    return problems


# The keys of a section's options that only some of its modes read: key -> (the modes that read it, what one of them
# makes of it). ``loss_inputs`` and ``OffPolicyCorrection`` read a correction's; ``overlong_shaping`` reads
# ``penalty_factor`` only with a ``buffer``.
_CORRECTION_READERS = {"cap": (("tis",), "cap each weight at it"),
                       "low": (("mask",), "drop the tokens whose ratio leaves [low, high]"),
                       "high": (("mask",), "drop the tokens whose ratio leaves [low, high]"),
                       "level": (("tis", "mask"), "weigh each completion by one ratio")}

# The keys of a section that only some of its settings read: key -> (whether the section reads it, the setting that
# keeps it unread, formatted with the section, what to set instead). The KL term (and its estimator) exists only with
# ``kl_coef`` > 0; ``grpo_advantages`` adds ``adv_eps`` to a std that ``scale_rewards: none`` never divides by.
_SECTION_READERS = {"kl_estimator": (lambda s: s["kl_coef"] > 0, "kl_coef is {kl_coef}",
                                     "kl_coef > 0 to add the KL to the reference"),
                    "dynamic_sampling_max_rounds": (lambda s: s["dynamic_sampling"], "dynamic_sampling is false",
                                                    "dynamic_sampling: true to draw further rounds"),
                    "adv_eps": (lambda s: s["scale_rewards"] != "none", "scale_rewards is none",
                                "scale_rewards: group or batch to divide the advantages by a std")}


def unread_problems(name: str, section: dict) -> list[str]:
    """One line for each option key of ``section`` set off its schema default that its mode does not read (a
    correction's key its ``name`` ignores, ``overlong.penalty_factor`` without a ``buffer``): it would change
    nothing."""
    default = defaults(name)[name]   # the schema's, its single source
    problems = []
    c, d = section["off_policy_correction"], default["off_policy_correction"]
    for key, (modes, what) in _CORRECTION_READERS.items():
        if c["name"] not in modes and c[key] != d[key]:
            problems.append(f"{name}.off_policy_correction.{key}: {c[key]} changes nothing while "
                            f"{name}.off_policy_correction.name is {c['name']}; set name: {' or '.join(modes)} to "
                            f"{what}, or leave {key} at {d[key]}")
    for key, (reads, why, what) in _SECTION_READERS.items():
        if key in section and not reads(section) and section[key] != default[key]:
            problems.append(f"{name}.{key}: {section[key]} changes nothing while {name}.{why.format_map(section)}; "
                            f"set {what}, or leave {key} at {default[key]}")
    o, d = section["overlong"], default["overlong"]
    if o["buffer"] is None and o["penalty_factor"] != d["penalty_factor"]:
        problems.append(f"{name}.overlong.penalty_factor: {o['penalty_factor']} changes nothing while "
                        f"{name}.overlong.buffer is null; set buffer to ramp the penalty over the last `buffer` "
                        f"tokens, or leave penalty_factor at {d['penalty_factor']}")
    return problems


@dataclass
class ValueLoss:
    """Clipped value loss and its diagnostics."""

    loss: Tensor       # aggregated 0.5 * max((V-R)^2, (clip(V, V_old +- c) - R)^2)
    clip_frac: Tensor  # share of tokens where the clipped error was the larger one
    error: Tensor      # mean squared error (V - R)^2 over the mask


@dataclass(frozen=True)
class ClippedValueLoss:
    """``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` with ``c = ppo.value_clip``."""

    clip: float
    loss_agg: str
    max_len: int | None = None

    @classmethod
    def from_section(cls, section: dict, max_len: int) -> ClippedValueLoss:
        return cls(section["value_clip"], section["loss_agg"], max_len)

    def __call__(self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor) -> ValueLoss:
        old = old_values.detach()
        ret = returns.detach()
        v_clipped = old + torch.clamp(values - old, -self.clip, self.clip)
        err = (values - ret).square()
        err_clipped = (v_clipped - ret).square()
        per_token = 0.5 * torch.maximum(err, err_clipped)
        loss = aggregate(per_token, mask, self.loss_agg, self.max_len)
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
