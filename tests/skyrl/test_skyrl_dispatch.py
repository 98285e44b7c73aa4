"""``ArcticDispatch`` against a stand-in arctic client that computes log-probs as arctic's engines do."""

from __future__ import annotations

import asyncio

import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from arctic_rl_core.engines.token_outputs import token_outputs
from arctic_rl_core.processors import resolve_post
from arctic_rl_skyrl.algorithm import check_supported
from arctic_rl_skyrl.config import ArcticSkyRLTrainConfig
from arctic_rl_skyrl.dispatch import ArcticDispatch

PROMPTS = [[5, 6, 7], [8, 9]]
RESPONSES = [[20, 21, 22], [22, 23, 24, 25]]


class EngineClient:
    """fwd_no_grad as arctic's engines serve it: log-probs of the batch with the processing's post-processors."""

    def __init__(self, model):
        self.model = model
        self.processing = []

    async def fwd_no_grad(self, batch, reference_model, processing):
        self.processing.append((reference_model, processing))
        sequences, attention = batch["args"][0], batch["kwargs"]["attention_mask"]
        select = torch.zeros_like(attention, dtype=torch.bool)
        select[:, :-1] = attention[:, :-1].bool() & attention[:, 1:].bool()
        post = resolve_post(processing["post"] if processing else None)
        with torch.no_grad():
            return {"log_probs_shifted": token_outputs(self.model, sequences, attention, select, post=post).logprobs}


class Session:
    def __init__(self, client):
        self.client = client

    def call(self, method):
        return asyncio.run(method(self.client))


def skyrl_batch() -> TrainingInputBatch:
    rewards = [[0.0] * (len(r) - 1) + [1.0] for r in RESPONSES]
    loss_masks = [[1] * len(r) for r in RESPONSES]
    sequences, attention, response_mask, _, loss_mask, *_ = convert_prompts_responses_to_batch_tensors(
        0, PROMPTS, RESPONSES, rewards, loss_masks
    )
    data = TrainingInputBatch({"sequences": sequences, "attention_mask": attention, "loss_mask": loss_mask})
    data.metadata = {"response_length": response_mask.shape[1]}
    return data


def expected_log_probs(model, temperature: float) -> list[torch.Tensor]:
    """Each response token's log-prob under ``softmax(logits / temperature)``, row by row."""
    rows = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0]
        log_probs = (logits / temperature).log_softmax(-1)
        rows.append(torch.stack([log_probs[len(prompt) - 1 + j, token] for j, token in enumerate(response)]))
    return rows


def test_reference_log_probs_are_at_temperature_one_and_the_policy_at_the_sampling_temperature(tiny_model):
    """SkyRL's RefWorker computes reference log-probs at temperature 1.0; the policy's follow algorithm.temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    cfg = ArcticSkyRLTrainConfig.from_cli_overrides(
        [f"trainer.policy.model.path={tiny_model}", "generator.sampling_params.temperature=0.6"]
    )
    client = EngineClient(model)
    dispatch = ArcticDispatch(Session(client), check_supported(cfg), colocated=False)
    data = skyrl_batch()
    reference = dispatch.forward("ref", data).loss_fn_outputs
    policy = dispatch.forward("policy", data).loss_fn_outputs
    for outputs, temperature in ((reference, 1.0), (policy, 0.6)):
        for row, expected in zip(outputs, expected_log_probs(model, temperature)):
            got = torch.tensor(row["logprobs"])[-len(expected) :]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert client.processing[0] == (True, None)
