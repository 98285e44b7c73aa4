"""verl's jagged TensorDicts to arctic-rl's padded batches, and arctic's outputs back.

verl 0.9.1 hands engines one row per sequence with no padding: ``input_ids``
is a jagged nested tensor (prompt then response), and the response-aligned
fields (``response_mask``/``loss_mask``, ``old_log_probs``, ``advantages``,
``ref_log_prob``, ``rollout_log_probs``) are jagged over the response only.

arctic-rl takes a right-padded ``[B, T]`` batch whose RL tensors are in the
shifted layout: entry t belongs to the prediction of token t + 1. A response
that starts at position p therefore puts its token j at shifted index
p + j - 1, and verl's per-sequence log-probs are the first ``len`` entries of
arctic's shifted row (verl's ``response_from_nested`` reads them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

# verl's response-aligned fields -> arctic-rl's context keys.
RESPONSE_FIELDS = {
    "advantages": "advantages",
    "old_log_probs": "old_log_probs_shifted",
    "ref_log_prob": "ref_log_probs_shifted",
}


def _rows(data: TensorDict, key: str) -> list[torch.Tensor]:
    value = data[key]
    if not (isinstance(value, torch.Tensor) and value.is_nested):
        raise ValueError(
            f"verl batch field {key!r}: the arctic engine reads verl's unpadded (nested) layout of the v1 trainer, "
            f"got {type(value).__name__}"
        )
    return list(value.unbind())


@dataclass(frozen=True)
class SequenceLayout:
    """Where each sequence's prompt and response sit in the padded ``[B, T]`` batch."""

    lengths: list[int]
    prompt_lengths: list[int]

    @classmethod
    def of(cls, data: TensorDict) -> "SequenceLayout":
        lengths = [len(row) for row in _rows(data, "input_ids")]
        if "response_mask" not in data:
            # Forward-only calls need no response bounds: every position is read back.
            return cls(lengths, list(lengths))
        responses = [len(row) for row in _rows(data, "response_mask")]
        prompts = [total - response for total, response in zip(lengths, responses, strict=True)]
        if any(p < 1 for p in prompts):
            raise ValueError(
                f"verl batch: every sequence needs a prompt token before its response, got prompt lengths {prompts}"
            )
        return cls(lengths, prompts)

    @property
    def width(self) -> int:
        return max(self.lengths)

    def padded(self, rows: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(len(rows), self.width, dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row.to(dtype)
        return out

    def model_inputs(self, data: TensorDict) -> dict:
        """``args``/``kwargs`` of an arctic batch: input_ids [B, T] and its attention mask."""
        input_ids = self.padded(_rows(data, "input_ids"), torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, length in enumerate(self.lengths):
            attention_mask[i, :length] = 1
        return {"args": [input_ids], "kwargs": {"attention_mask": attention_mask}}

    def shifted_response(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Response-aligned rows placed at shifted positions p + j - 1 of a float [B, T] grid."""
        out = torch.zeros(len(rows), self.width, dtype=torch.float32)
        for i, (row, start) in enumerate(zip(rows, self.prompt_lengths, strict=True)):
            out[i, start - 1 : start - 1 + len(row)] = row.float()
        return out

    def full_rows(self, shifted: torch.Tensor) -> torch.Tensor:
        """A shifted ``[B, T]`` result as verl's jagged per-sequence tensor (length = sequence length)."""
        return torch.nested.as_nested_tensor(
            [shifted[i, :length].float() for i, length in enumerate(self.lengths)], layout=torch.jagged
        )


def loss_batch(data: TensorDict, layout: SequenceLayout, decoupled_ppo: bool) -> dict:
    """The arctic ``fwd_bwd`` batch for one verl mini-batch.

    With ``decoupled_ppo`` (verl's token TIS), verl's recomputed old log-probs
    are the proximal policy and its rollout log-probs the behaviour policy.
    """
    context = {"loss_mask_shifted": layout.shifted_response(_rows(data, "response_mask"))}
    for field, key in RESPONSE_FIELDS.items():
        if field in data:
            context[key] = layout.shifted_response(_rows(data, field))
    if decoupled_ppo:
        if "rollout_log_probs" not in data:
            raise ValueError(
                "verl batch has no rollout_log_probs, which token TIS needs: set "
                "actor_rollout_ref.rollout.calculate_log_probs=true"
            )
        context["prox_logp_shifted"] = context.pop("old_log_probs_shifted")
        context["old_log_probs_shifted"] = layout.shifted_response(_rows(data, "rollout_log_probs"))
    return {**layout.model_inputs(data), "context": context}


def scalar_temperature(data: TensorDict) -> float:
    """verl's sampling temperature of this batch (a number, or one equal value per row)."""
    from verl.utils import tensordict_utils as tu

    temperature = tu.get(data, "temperature", 1.0)
    if isinstance(temperature, torch.Tensor):
        values = temperature.flatten().unique()
        if values.numel() != 1:
            raise ValueError(
                f"verl batch: per-row temperatures {values.tolist()} are not supported; arctic-rl applies one per call"
            )
        return float(values.item())
    return float(temperature)


def post_processing(temperature: float) -> list:
    """arctic-rl's ``post`` entries for verl's temperature (none at 1.0)."""
    return [] if temperature == 1.0 else [{"name": "temperature", "config": {"temperature": temperature}}]
