"""Policy-gradient losses: the clipped surrogate (``grpo``, ``ppo``) and Tinker's ``importance_sampling``.

Advantages always come from the caller (group-normalized for GRPO; RLOO,
REINFORCE++ or GAE computed outside for PPO): these losses are value-free.

Clipped surrogate, per loss token, with r = pi / pi_anchor and advantage A::

    loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))
    if clip_ratio_c and A < 0:  loss = min(loss, -A * clip_ratio_c)         (dual clip)
    loss *= w                                                              (decoupled PPO)
    total = agg(loss) + kl_coef * agg_kl(KL(pi || pi_ref)) - entropy_coef * agg_H(H)

``agg`` is ``loss_agg_mode``; the KL and entropy terms use it too unless
``kl_agg_mode`` / ``entropy_agg_mode`` say otherwise (SkyRL reduces them in
fixed modes of their own).

The anchor is the first present of ``prox_logp_shifted``, ``old_log_probs_shifted``,
and the detached current log-probs. Without old log-probs (pure on-policy,
one update per batch) r is 1 with the gradient of log pi, which makes the
loss REINFORCE with the caller's advantages.

Decoupled PPO (AReaL): with both ``prox_logp_shifted`` and
``old_log_probs_shifted``, the ratio is taken against the proximal policy and
the behaviour importance weight w = pi_prox / pi_old (a constant: it depends
on no parameter) corrects for the sampler's staleness. ``behav_imp_weight_cap``
bounds it: ``truncate`` (default) uses min(w, cap), truncated importance
sampling (TIS); ``mask`` drops tokens with w > cap, as AReaL does.

Metrics (token-weighted means unless noted): ``pg_loss`` (the policy term of
the loss as aggregated), ``clip_frac`` (tokens where the clipped branch is the
active one), ``dual_clip_frac``, ``ratio_mean``, ``ratio_max`` (max-reduced),
``approx_kl`` = mean of (r - 1) - log r, the k3 estimate of KL(pi_anchor || pi)
from tokens sampled by the anchor, ``kl`` (to the reference, whenever
reference log-probs are given), ``entropy`` (whenever computed),
``behav_imp_weight`` (decoupled PPO).

Ratios are formed from log-ratios clamped to [-20, 20], as verl does, so a
stale token cannot overflow float32.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from arctic_rl_core.processors.aggregation import (
    AggMode,
    AggregatedLossConfig,
    aggregate,
    masked_max,
    share_metric,
    token_mean_metric,
)
from arctic_rl_core.processors.base import LossInputs, LossOutput
from arctic_rl_core.processors.kl import KLEstimator, kl_estimate
from arctic_rl_core.processors.registry import register_loss

MAX_LOG_RATIO = 20.0

Metrics = dict[str, tuple[Tensor, Tensor]]


class ClippedPolicyConfig(AggregatedLossConfig):
    """Config of ``grpo``: PPO's clipped surrogate with GRPO's defaults (no dual clip)."""

    eps_clip: float = Field(
        0.2, gt=0, lt=1, description="Ratio clip: r is kept within [1 - eps_clip, 1 + eps_clip_high]."
    )
    eps_clip_high: float | None = Field(
        None, gt=0, description="Upper clip (clip-higher, DAPO; e.g. 0.28). None: eps_clip."
    )
    clip_ratio_c: float | None = Field(
        None, gt=1, description="Dual clip: for A < 0 the token loss is at most -A * clip_ratio_c. None: off."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference policy.")
    kl_estimator: KLEstimator = Field(
        "k3",
        description="k1, k2, k3 (clamped as verl), k3_unclamped (as TRL) or abs; verl's kl, mse, low_var_kl accepted.",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus: the loss decreases by entropy_coef * entropy.")
    kl_agg_mode: AggMode | None = Field(
        None, description="Aggregation of the KL term. None: loss_agg_mode (verl); SkyRL: seq-mean-token-mean."
    )
    entropy_agg_mode: AggMode | None = Field(
        None, description="Aggregation of the entropy term. None: loss_agg_mode (verl); SkyRL: token-mean."
    )
    behav_imp_weight_cap: float | None = Field(
        None, gt=0, description="Bound of the behaviour weight pi_prox / pi_old in decoupled PPO. None: unbounded."
    )
    behav_imp_weight_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: min(w, cap) (TIS). mask: drop tokens with w > cap (AReaL)."
    )

    @property
    def upper_clip(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def required_context(self) -> frozenset[str]:
        return frozenset({"advantages", "ref_log_probs_shifted"} if self.kl_coef > 0 else {"advantages"})

    def optional_context(self) -> frozenset[str]:
        return frozenset({"old_log_probs_shifted", "prox_logp_shifted", "ref_log_probs_shifted"})

    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0


class PPOConfig(ClippedPolicyConfig):
    """Config of ``ppo``: the same surrogate, with the dual clip on (3.0) as verl's PPO defaults."""

    clip_ratio_c: float | None = Field(
        3.0, gt=1, description="Dual clip: for A < 0 the token loss is at most -A * clip_ratio_c. None: off."
    )


class ImportanceSamplingConfig(AggregatedLossConfig):
    """Config of ``importance_sampling``. ``token-sum`` reproduces Tinker's loss exactly; the default
    ``token-mean`` divides it by the call's loss tokens so the step size does not grow with the batch."""

    def required_context(self) -> frozenset[str]:
        return frozenset({"advantages", "old_log_probs_shifted"})


def _log_ratio(logprobs: Tensor, anchor: Tensor) -> Tensor:
    return (logprobs - anchor).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, inputs: LossInputs) -> Metrics:
    """The metrics every ratio-based loss reports."""
    metrics = {
        "ratio_mean": token_mean_metric(ratio, inputs.mask),
        "approx_kl": token_mean_metric((ratio - 1.0) - log_ratio, inputs.mask),
    }
    if inputs.entropy is not None:
        metrics["entropy"] = token_mean_metric(inputs.entropy, inputs.mask)
    return metrics


def _behaviour_weight(inputs: LossInputs, config: ClippedPolicyConfig) -> Tensor:
    """pi_prox / pi_old per token, bounded by the cap; it depends on no parameter, so no gradient flows through it."""
    weight = _log_ratio(inputs.per_token("prox_logp_shifted"), inputs.per_token("old_log_probs_shifted")).exp()
    cap = config.behav_imp_weight_cap
    if cap is None:
        return weight
    if config.behav_imp_weight_mode == "truncate":
        return weight.clamp(max=cap)
    return torch.where(weight <= cap, weight, torch.zeros_like(weight))


def clipped_policy_loss(inputs: LossInputs, config: ClippedPolicyConfig) -> LossOutput:
    """The clipped surrogate with dual clip, decoupled-PPO weights, KL penalty and entropy bonus."""
    mask = inputs.mask
    logprobs = inputs.logprobs.float()
    advantages = inputs.per_token("advantages")
    if inputs.has("prox_logp_shifted"):
        anchor = inputs.per_token("prox_logp_shifted")
    elif inputs.has("old_log_probs_shifted"):
        anchor = inputs.per_token("old_log_probs_shifted")
    else:
        anchor = logprobs.detach()
    log_ratio = _log_ratio(logprobs, anchor)
    ratio = log_ratio.exp()

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.eps_clip, 1.0 + config.upper_clip)
    token_loss = torch.maximum(unclipped, clipped)
    metrics = _ratio_metrics(ratio, log_ratio, inputs)
    metrics["clip_frac"] = token_mean_metric((clipped > unclipped).float(), mask)

    if config.clip_ratio_c is not None:
        bound = -advantages * config.clip_ratio_c
        dual_clipped = (advantages < 0) & (token_loss > bound)
        token_loss = torch.where(dual_clipped, bound, token_loss)
        metrics["dual_clip_frac"] = token_mean_metric(dual_clipped.float(), mask)

    if inputs.has("prox_logp_shifted") and inputs.has("old_log_probs_shifted"):
        weight = _behaviour_weight(inputs, config)
        token_loss = token_loss * weight
        metrics["behav_imp_weight"] = token_mean_metric(weight, mask)

    def agg(values: Tensor, mode: AggMode | None = None) -> Tensor:
        return aggregate(values, inputs, mode or config.loss_agg_mode, config.num_sequences)

    pg_loss = agg(token_loss)
    metrics["pg_loss"] = share_metric(pg_loss, inputs)
    loss = pg_loss

    if inputs.has("ref_log_probs_shifted"):
        kl = kl_estimate(logprobs, inputs.per_token("ref_log_probs_shifted"), config.kl_estimator)
        metrics["kl"] = token_mean_metric(kl, mask)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * agg(kl, config.kl_agg_mode)

    if config.entropy_coef != 0:
        if inputs.entropy is None:
            raise RuntimeError(f"entropy_coef={config.entropy_coef} needs entropy, but the engine passed none")
        loss = loss - config.entropy_coef * agg(inputs.entropy.float(), config.entropy_agg_mode)

    return LossOutput(loss=loss, metrics=metrics, maxima={"ratio_max": masked_max(ratio, mask)})


@register_loss(
    "grpo",
    config_model=ClippedPolicyConfig,
    aliases=("arctic_platform.rl.processors.grpo_loss", "arctic_rl_core.processors.grpo_loss"),
)
def grpo_loss(inputs: LossInputs, config: ClippedPolicyConfig) -> LossOutput:
    return clipped_policy_loss(inputs, config)


@register_loss("ppo", config_model=PPOConfig)
def ppo_loss(inputs: LossInputs, config: PPOConfig) -> LossOutput:
    return clipped_policy_loss(inputs, config)


@register_loss("importance_sampling", config_model=ImportanceSamplingConfig)
def importance_sampling_loss(inputs: LossInputs, config: ImportanceSamplingConfig) -> LossOutput:
    """Off-policy REINFORCE with importance weights, as Tinker defines it: -(pi / pi_old) * A per token."""
    log_ratio = _log_ratio(inputs.logprobs.float(), inputs.per_token("old_log_probs_shifted"))
    ratio = log_ratio.exp()
    pg_loss = aggregate(-ratio * inputs.per_token("advantages"), inputs, config.loss_agg_mode, config.num_sequences)
    metrics = {**_ratio_metrics(ratio, log_ratio, inputs), "pg_loss": share_metric(pg_loss, inputs)}
    return LossOutput(loss=pg_loss, metrics=metrics, maxima={"ratio_max": masked_max(ratio, inputs.mask)})
