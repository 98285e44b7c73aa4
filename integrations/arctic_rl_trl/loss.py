"""GRPOConfig's loss as one fwd_bwd of the arctic ``grpo`` loss.

TRL divides a micro-batch's summed per-token loss by a constant that depends
on ``loss_type`` (G = gradient accumulation steps of the step, 1 in
evaluation; B = rows of the micro-batch; m = its completion mask):

===========  =================================================  =========================  ====================
loss_type    TRL's micro-batch loss                             arctic ``loss_agg_mode``   scale s
===========  =================================================  =========================  ====================
grpo         mean over rows of (row token mean) / G             seq-mean-token-mean        rows with m / (B G)
bnpo         sum / m.sum() / G                                  token-mean                 1 / G
dr_grpo      sum / (B * max_completion_length) / G              token-sum                  1 / (B L G)
dapo         sum / (completion tokens of the step)              token-sum                  1 / that count
===========  =================================================  =========================  ====================

The clipped surrogate is positively homogeneous in the advantage, so the
scale (and TRL's importance-sampling ratio, also a non-negative constant per
token) rides on per-token advantages, and the KL coefficient is scaled by the
same s: the arctic loss of the call then equals TRL's micro-batch loss, and so
do its gradients. TRL's entropy bonus is a token mean divided by G whatever
the loss type; the entropy coefficient is converted to each aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import GRPOConfig

from arctic_rl_core.processors import LossInputs, LossOutput, loss_mask_from_context, resolve_loss
from arctic_rl_trl.batch import Rows, prompt_grouped_order

AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "token-sum",
    "dapo": "token-sum",
}


@dataclass(frozen=True)
class LossMapping:
    """The loss options of a GRPOConfig that reach the training engine (already checked by ``compat``)."""

    loss_type: str
    epsilon: float
    epsilon_high: float
    delta: float | None
    beta: float
    entropy_coef: float
    temperature: float
    max_completion_length: int

    @classmethod
    def from_args(cls, args: GRPOConfig) -> "LossMapping":
        return cls(
            loss_type=args.loss_type,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
            delta=args.delta,
            beta=args.beta,
            entropy_coef=args.entropy_coef,
            temperature=args.temperature,
            max_completion_length=args.max_completion_length,
        )

    @property
    def aggregation(self) -> str:
        return AGGREGATION[self.loss_type]

    def scale(self, loss_mask: torch.Tensor, accumulation_steps: int, step_tokens: float) -> float:
        """s: TRL's loss of this micro-batch over the arctic aggregation of the same per-token losses.

        ``loss_mask`` is the micro-batch's completion mask [B, C]; ``step_tokens``
        the completion tokens TRL's ``dapo`` divides by.
        """
        rows = loss_mask.shape[0]
        if self.loss_type == "grpo":
            rows_with_tokens = int((loss_mask.sum(-1) > 0).sum())
            return rows_with_tokens / (rows * accumulation_steps)
        if self.loss_type == "bnpo":
            return 1.0 / accumulation_steps
        if self.loss_type == "dr_grpo":
            return 1.0 / (rows * self.max_completion_length * accumulation_steps)
        return 1.0 / max(step_tokens, 1.0)

    def post(self) -> list[dict]:
        """Post-processors: TRL scores log-probs of the logits divided by the sampling temperature."""
        if self.temperature == 1.0:
            return []
        return [{"name": "temperature", "config": {"temperature": self.temperature}}]

    def processing(self, scale: float, loss_tokens: float, accumulation_steps: int) -> dict:
        """The fwd_bwd ``processing`` of one micro-batch with ``loss_tokens`` completion tokens."""
        config = {
            "eps_clip": self.epsilon,
            "eps_clip_high": self.epsilon_high,
            "kl_coef": self.beta * scale,
            "kl_estimator": "k3_unclamped",  # TRL's k3 has none of verl's clamps
            "loss_agg_mode": self.aggregation,
        }
        if self.delta is not None:
            config["clip_ratio_c"] = self.delta
        if self.entropy_coef != 0.0:
            # TRL: entropy_coef * (token mean of the entropy) / G, whatever the loss type.
            per_aggregate = 1.0 if self.aggregation == "token-mean" else 1.0 / max(loss_tokens, 1.0)
            config["entropy_coef"] = self.entropy_coef * per_aggregate / accumulation_steps
        return {"loss_fn": "grpo", "config": config, "post": self.post()}


@dataclass
class LossBatch:
    """One TRL micro-batch as the rows, context and processing of a fwd_bwd call."""

    rows: Rows
    context: dict[str, torch.Tensor]
    processing: dict

    def evaluate(self, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> LossOutput:
        """The same loss in this process, from log-probs (and entropy) in the shifted layout."""
        spec = resolve_loss(self.processing["loss_fn"])
        mask = loss_mask_from_context(self.context, self.rows.attention_mask).to(logprobs.device)
        inputs = LossInputs(
            logprobs=logprobs * mask,
            mask=mask,
            context=self.context,
            entropy=entropy,
            global_tokens=float(mask.sum()),
            global_seqs=float((mask.sum(-1) > 0).sum()),
            horizon=self.rows.total_length,
        )
        return spec(inputs, spec.parse_config(self.processing["config"]))


def loss_batch(inputs: dict, mapping: LossMapping, accumulation_steps: int, step_tokens: float) -> LossBatch:
    """TRL's micro-batch ``inputs`` (the output of ``_prepare_inputs``) for the arctic grpo loss.

    Rows are reordered so each prompt's group is contiguous; the loss is a sum
    over rows, so the order changes nothing but what ZoRRo Train can share.
    """
    order = prompt_grouped_order(inputs["prompt_ids"], inputs["prompt_mask"])
    rows_of = {k: v[order.to(v.device)] for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    rows = Rows.from_completions(
        rows_of["prompt_ids"], rows_of["prompt_mask"], rows_of["completion_ids"], rows_of["completion_mask"]
    )
    mask = completion_loss_mask(rows_of).float()
    scale = mapping.scale(mask, accumulation_steps, step_tokens)
    advantages = rows_of["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    weights = advantages.expand_as(mask) * scale
    if "importance_sampling_ratio" in rows_of:
        weights = weights * rows_of["importance_sampling_ratio"]
    context = {"advantages": rows.shifted(weights), "loss_mask_shifted": rows.shifted(mask)}
    if "old_per_token_logps" in rows_of:
        context["old_log_probs_shifted"] = rows.shifted(rows_of["old_per_token_logps"])
    if mapping.beta != 0.0:
        context["ref_log_probs_shifted"] = rows.shifted(rows_of["ref_per_token_logps"])
    return LossBatch(rows, context, mapping.processing(scale, float(mask.sum()), accumulation_steps))


def completion_loss_mask(inputs: dict) -> torch.Tensor:
    """TRL's loss mask: completion tokens, less tool outputs."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
