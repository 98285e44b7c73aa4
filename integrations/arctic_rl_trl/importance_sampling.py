"""TRL's importance-sampling correction of the sampler/trainer mismatch, for the arctic sampler.

TRL applies ``vllm_importance_sampling_*`` when vLLM samples; here the arctic
sampling engine plays that part, so the same options apply to it. The weight
of a completion token is pi_trainer / pi_sampler, per token or as one product
per sequence, then truncated to [clip_min, clip_max] or zeroed outside it.
The policy loss of each token is multiplied by it (the KL term is not).

A deployment the trainer starts reports processed log-probs, as TRL's own
vLLM does (``logprobs_mode="processed_logprobs"``), and the trainer side is
TRL's: the training engine's log-probs at the sampling temperature. A running
deployment whose sampler reports raw log-probs gets a trainer side at
temperature 1 instead, so that both sides score the same logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trl import GRPOConfig

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class ImportanceSamplingCorrection:
    mode: str
    clip_min: float | None
    clip_max: float | None

    @classmethod
    def from_args(cls, args: GRPOConfig) -> "ImportanceSamplingCorrection | None":
        if not args.vllm_importance_sampling_correction:
            return None
        if args.vllm_importance_sampling_mode not in MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r} is not one of {', '.join(MODES)}"
            )
        return cls(
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min,
            args.vllm_importance_sampling_clip_max,
        )

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")

    def ratio(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The weights: [B, C] per token, or [B, 1] per sequence. Tokens the sampler did not score (NaN) weigh 1."""
        log_ratio = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)
        if self.per_sequence:
            log_ratio = log_ratio.sum(-1, keepdim=True)
        ratio = log_ratio.exp()
        if self.mode.endswith("truncate"):
            return ratio.clamp(min=self.clip_min, max=self.clip_max)
        low = self.clip_min if self.clip_min is not None else -math.inf
        high = self.clip_max if self.clip_max is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    def metrics(
        self, ratio: torch.Tensor, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """TRL's ``sampling/*`` metrics: the log-prob gap on scored tokens and the spread of the weights."""
        tokens = mask.bool()
        gap = (trainer_logps - sampler_logps).abs()[tokens & ~torch.isnan(sampler_logps)]
        weights = ratio.flatten() if self.per_sequence else ratio[tokens]

        def stat(values: torch.Tensor, reduce) -> float:
            return float(reduce(values)) if values.numel() else 0.0

        return {
            "sampling/sampling_logp_difference/mean": stat(gap, torch.mean),
            "sampling/sampling_logp_difference/max": stat(gap, torch.max),
            "sampling/importance_sampling_ratio/min": stat(weights, torch.min),
            "sampling/importance_sampling_ratio/mean": stat(weights, torch.mean),
            "sampling/importance_sampling_ratio/max": stat(weights, torch.max),
        }
