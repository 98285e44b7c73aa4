"""Losses and post-processors of the training engine, looked up by name.

Importing this package registers the built-in losses: ``grpo`` (aliases
``arctic_platform.rl.processors.grpo_loss`` and
``arctic_rl_core.processors.grpo_loss``), ``ppo``, ``importance_sampling`` and
``sft``. How the engine uses them, per fwd_bwd call:

1. ``spec = resolve_loss(processing["loss_fn"], allowed_prefixes)``,
   ``config = spec.parse_config(processing["config"])``,
   ``post = resolve_post(processing["post"])``.
2. ``validate_batch_context(spec, config, context, (B, T))`` and
   ``mask = loss_mask_from_context(context, attention_mask)``: bad requests fail
   here, before any forward pass, with a :class:`ProcessingError` (4xx).
3. Per micro-batch: logits of the loss rows -> ``post(logits)`` ->
   ``compute_logprobs``, or ``compute_logprobs_and_entropy`` when
   ``spec.needs_entropy(config) or post.wants_entropy`` -> ``spec(LossInputs(...), config)``
   -> backward on ``LossOutput.loss``.
4. Sum losses, metric (sum, weight) pairs and maxima over micro-batches and ranks.
"""

from arctic_rl_core.processors.aggregation import AggMode, AggregatedLossConfig, aggregate
from arctic_rl_core.processors.base import (
    BatchValidationError,
    LossConfig,
    LossConfigError,
    LossInputs,
    LossOutput,
    PostProcessingError,
    ProcessingError,
    UnknownLossError,
)
from arctic_rl_core.processors.context import CONTEXT_LAYOUTS, validate_batch_context
from arctic_rl_core.processors.kl import KLEstimator, kl_estimate
from arctic_rl_core.processors.masks import loss_mask_from_context, shifted_attention_mask
from arctic_rl_core.processors.policy_loss import (
    ClippedPolicyConfig,
    ImportanceSamplingConfig,
    PPOConfig,
    grpo_loss,
    importance_sampling_loss,
    ppo_loss,
)
from arctic_rl_core.processors.post import (
    PostPipeline,
    apply_temperature,
    compute_entropy,
    compute_logprobs,
    compute_logprobs_and_entropy,
    register_logit_transform,
    resolve_post,
)
from arctic_rl_core.processors.registry import LossSpec, register_loss, registered_losses, resolve_loss
from arctic_rl_core.processors.sft import SFTConfig, sft_loss

__all__ = [
    "AggMode",
    "AggregatedLossConfig",
    "BatchValidationError",
    "CONTEXT_LAYOUTS",
    "ClippedPolicyConfig",
    "ImportanceSamplingConfig",
    "KLEstimator",
    "LossConfig",
    "LossConfigError",
    "LossInputs",
    "LossOutput",
    "LossSpec",
    "PPOConfig",
    "PostPipeline",
    "PostProcessingError",
    "ProcessingError",
    "SFTConfig",
    "UnknownLossError",
    "aggregate",
    "apply_temperature",
    "compute_entropy",
    "compute_logprobs",
    "compute_logprobs_and_entropy",
    "grpo_loss",
    "importance_sampling_loss",
    "kl_estimate",
    "loss_mask_from_context",
    "ppo_loss",
    "register_logit_transform",
    "register_loss",
    "registered_losses",
    "resolve_loss",
    "resolve_post",
    "sft_loss",
    "shifted_attention_mask",
    "validate_batch_context",
]
