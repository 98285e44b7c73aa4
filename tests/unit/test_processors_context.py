"""The batch contract: context validation at the edge, and the shifted loss mask."""

import pytest
import torch

from arctic_rl_core.processors import (
    BatchValidationError,
    loss_mask_from_context,
    resolve_loss,
    validate_batch_context,
)

B, T = 2, 5


def _validate(loss: str, config: dict, context: dict) -> None:
    spec = resolve_loss(loss)
    validate_batch_context(spec, spec.parse_config(config), context, batch_shape=(B, T))


def test_per_sequence_and_per_token_advantages_are_both_accepted():
    _validate("grpo", {}, {"advantages": torch.zeros(B)})
    _validate("grpo", {}, {"advantages": torch.zeros(B, T), "old_log_probs_shifted": torch.zeros(B, T)})


def test_keys_no_loss_reads_are_ignored():
    _validate("sft", {}, {"response_mask": torch.ones(B, T), "anything_else": "not a tensor"})


def test_missing_advantages_are_named():
    with pytest.raises(BatchValidationError, match=r"loss 'grpo'.*needs context 'advantages' \(\[B\] or \[B, T\]\)"):
        _validate("grpo", {}, {"old_log_probs_shifted": torch.zeros(B, T)})


def test_kl_coef_makes_the_reference_logprobs_required():
    with pytest.raises(BatchValidationError, match=r"'ref_log_probs_shifted' \(\[B, T\]\)"):
        _validate("grpo", {"kl_coef": 0.1}, {"advantages": torch.zeros(B)})


def test_importance_sampling_needs_the_sampler_logprobs():
    with pytest.raises(BatchValidationError, match="old_log_probs_shifted"):
        _validate("importance_sampling", {}, {"advantages": torch.zeros(B)})


@pytest.mark.parametrize(
    "context, message",
    [
        (
            {"advantages": torch.zeros(B), "old_log_probs_shifted": torch.zeros(B, T - 1)},
            r"context\['old_log_probs_shifted'\] must have shape \[B, T\] with B, T = 2, 5, got \[2, 4\]",
        ),
        (
            {"advantages": torch.zeros(B, 1)},
            r"context\['advantages'\] must have shape \[B\] or \[B, T\] with B, T = 2, 5, got \[2, 1\]",
        ),
        (
            {"advantages": torch.zeros(B + 1)},
            r"context\['advantages'\] must have shape .* got \[3\]",
        ),
        (
            {"advantages": torch.zeros(B, dtype=torch.long)},
            r"context\['advantages'\] must be a floating-point tensor, got dtype torch.int64",
        ),
        (
            {"advantages": [0.0, 1.0]},
            r"context\['advantages'\] must be a tensor \[B\] or \[B, T\] with B, T = 2, 5, got list",
        ),
        (
            {"advantages": torch.zeros(B), "prox_logp_shifted": torch.zeros(T, B)},
            r"context\['prox_logp_shifted'\] must have shape \[B, T\] with B, T = 2, 5, got \[5, 2\]",
        ),
    ],
)
def test_misshaped_or_mistyped_context_errors_name_the_key_and_both_shapes(context, message):
    with pytest.raises(BatchValidationError, match=message):
        _validate("grpo", {}, context)


def test_batch_validation_error_is_a_value_error():
    assert issubclass(BatchValidationError, ValueError)


def test_response_mask_is_shifted_by_one_and_padding_never_counts():
    attention = torch.tensor([[1, 1, 1, 1, 1, 0]])
    response = torch.tensor([[0, 0, 1, 1, 1, 0]])  # tokens 2..4 are the response; token 5 is padding
    mask = loss_mask_from_context({"response_mask": response}, attention)
    # position t predicts token t + 1: positions 1, 2, 3 predict the response tokens 2, 3, 4
    assert mask.dtype == torch.float32
    assert mask.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]


def test_shifted_loss_mask_is_anded_with_the_shifted_attention_mask():
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])  # left-padded, right-padded
    claimed = torch.ones(2, 5, dtype=torch.bool)
    mask = loss_mask_from_context({"loss_mask_shifted": claimed}, attention)
    # left pad: position 1 (a pad) would predict the first real token; last real position predicts nothing
    assert mask.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("context", [{}, {"response_mask": torch.ones(1, 3), "loss_mask_shifted": torch.ones(1, 3)}])
def test_exactly_one_loss_mask_must_be_given(context):
    with pytest.raises(BatchValidationError, match="exactly one loss mask: 'response_mask'.*'loss_mask_shifted'"):
        loss_mask_from_context(context, torch.ones(1, 3))


def test_loss_mask_must_be_binary():
    with pytest.raises(BatchValidationError, match=r"response_mask must hold only 0 and 1, found \[0.5\]"):
        loss_mask_from_context({"response_mask": torch.tensor([[0.0, 0.5, 1.0]])}, torch.ones(1, 3))


def test_loss_mask_shape_must_match_the_batch():
    with pytest.raises(BatchValidationError, match=r"context\['response_mask'\] must have shape .*got \[1, 4\]"):
        loss_mask_from_context({"response_mask": torch.ones(1, 4)}, torch.ones(1, 3))
