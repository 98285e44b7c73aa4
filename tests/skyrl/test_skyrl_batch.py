"""SkyRL's right-aligned response tensors against arctic's shifted layout, on batches SkyRL itself builds."""

from __future__ import annotations

import pytest
import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from arctic_rl_core.engines.token_outputs import token_outputs
from arctic_rl_core.processors import loss_mask_from_context
from arctic_rl_skyrl.batch import from_shifted, model_batch, response_columns, to_shifted, training_context

PAD = 0
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
RESPONSES = [[20, 21], [22, 23, 24], [25]]


def skyrl_batch():
    """The batch SkyRL's trainer builds from these prompts and responses (left-padded rows, right-aligned responses)."""
    rewards = [[0.0] * (len(r) - 1) + [1.0] for r in RESPONSES]
    loss_masks = [[1] * len(r) for r in RESPONSES]
    sequences, attention, response_mask, _, loss_mask, *_ = convert_prompts_responses_to_batch_tensors(
        PAD, PROMPTS, RESPONSES, rewards, loss_masks
    )
    data = TrainingInputBatch(
        {"sequences": sequences, "attention_mask": attention, "response_mask": response_mask, "loss_mask": loss_mask}
    )
    data.metadata = {"response_length": response_mask.shape[1]}
    return data


def test_response_columns_are_the_predictions_of_the_last_response_length_tokens():
    assert response_columns(sequence_length=6, response_length=3) == slice(2, 5)
    with pytest.raises(ValueError, match="response_length must be in"):
        response_columns(sequence_length=3, response_length=3)


def test_shifted_loss_mask_selects_exactly_the_positions_that_predict_response_tokens():
    data = skyrl_batch()
    width = data["sequences"].shape[1]
    mask = loss_mask_from_context({"loss_mask_shifted": to_shifted(data["loss_mask"], width)}, data["attention_mask"])
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        start = width - len(prompt) - len(response)  # left padding
        predicted = {int(data["sequences"][row, t + 1]) for t in range(width - 1) if mask[row, t]}
        assert predicted == set(response)
        assert mask[row].sum() == len(response)
        assert mask[row, : start + len(prompt) - 1].sum() == 0


def test_to_shifted_and_from_shifted_round_trip():
    response = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert torch.equal(from_shifted(to_shifted(response, 9), 4), response)


def test_log_probs_read_back_from_arctic_are_those_of_each_response_token(tiny_model):
    """arctic's engine computes shifted log-probs on SkyRL's padded rows; SkyRL reads the response window."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    data = skyrl_batch()
    attention = data["attention_mask"]
    select = torch.zeros_like(attention, dtype=torch.bool)
    select[:, :-1] = attention[:, :-1].bool() & attention[:, 1:].bool()
    with torch.no_grad():
        shifted = token_outputs(model, data["sequences"], attention, select).logprobs
    response_log_probs = from_shifted(shifted, data.metadata["response_length"])
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
        expected = torch.stack([logits[len(prompt) - 1 + j, token] for j, token in enumerate(response)])
        torch.testing.assert_close(response_log_probs[row, -len(response) :], expected, rtol=1e-5, atol=1e-5)


def test_training_context_places_every_rl_tensor_in_the_response_window():
    data = skyrl_batch()
    rows, response_length = data["loss_mask"].shape
    data["advantages"] = torch.full((rows, response_length), 0.5)
    data["action_log_probs"] = torch.full((rows, response_length), -1.0)
    data["base_action_log_probs"] = torch.full((rows, response_length), -2.0)
    data["rollout_logprobs"] = torch.full((rows, response_length), -3.0)
    context = training_context(data, reference=True, rollout_correction=True)
    assert set(context) == {
        "advantages",
        "loss_mask_shifted",
        "prox_logp_shifted",
        "old_log_probs_shifted",
        "ref_log_probs_shifted",
    }
    window = response_columns(data["sequences"].shape[1], response_length)
    assert torch.all(context["prox_logp_shifted"][:, window] == -1.0)
    assert torch.all(context["old_log_probs_shifted"][:, window] == -3.0)
    assert torch.all(context["ref_log_probs_shifted"][:, window] == -2.0)
    assert context["advantages"].sum() == 0.5 * rows * response_length


def test_horizon_pads_rows_with_masked_columns_only():
    data = skyrl_batch()
    width = data["sequences"].shape[1]
    context = {"loss_mask_shifted": to_shifted(data["loss_mask"], width)}
    batch = model_batch(data, context, horizon=width + 5)
    assert batch["args"][0].shape == (3, width + 5)
    assert batch["kwargs"]["attention_mask"][:, width:].sum() == 0
    assert torch.equal(batch["context"]["loss_mask_shifted"][:, :width], context["loss_mask_shifted"])
    with pytest.raises(ValueError, match="max_seq_len=4 is shorter"):
        model_batch(data, context, horizon=4)
