"""vLLM (its CPU build) as the sampling and log-prob engines behind the same client: train/sample parity."""

import pytest
import torch

from arctic_rl_core import create_arctic_rl_client
from tests.e2e.conftest import deployment_config, run

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_after_sync_vllm_log_probs_match_the_training_engine(tiny_model):
    client = create_arctic_rl_client(
        deployment_config(tiny_model, "http", sampling_engine="vllm", log_prob_engine="vllm")
    )

    async def scenario():
        try:
            prompts = ["What is 2 + 3?", "Name a color:"]
            ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 2)
            await client.fwd_bwd({"args": [ids]}, {"loss_fn": "sft"})
            await client.step()
            await client.sync_weights()
            norms = await client.weight_norm()
            results = await client.generate(prompts, {"max_tokens": 12, "temperature": 1.0, "n": 2, "seed": 7})
            rows = [(r["prompt_token_ids"], o["token_ids"], o["logprobs"]) for r in results for o in r["outputs"]]
            width = max(len(p) + len(c) for p, c, _ in rows)
            batch_ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros_like(batch_ids)
            for i, (p, c, _) in enumerate(rows):
                batch_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                mask[i, : len(p) + len(c)] = 1
            trained = await client.fwd_no_grad(
                {"args": [batch_ids], "kwargs": {"attention_mask": mask}}, reference_model=False
            )
            reference = await client.fwd_no_grad(
                {"args": [batch_ids], "kwargs": {"attention_mask": mask}}, reference_model=True
            )
            return norms, rows, trained["log_probs_shifted"], reference["log_probs_shifted"]
        finally:
            await client.shutdown()

    norms, rows, trained, reference = run(scenario())
    assert abs(norms["training_norm"] - norms["sampling_norm"]) / norms["training_norm"] < 1e-6
    diffs = []
    for i, (p, c, sampled) in enumerate(rows):
        # The shifted layout scores completion token j at position len(p) - 1 + j.
        diffs.append((trained[i, len(p) - 1 : len(p) - 1 + len(c)] - torch.tensor(sampled)).abs())
    diff = torch.cat(diffs)
    print(f"vLLM vs training log-probs after sync: mean {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() <= 1e-3
    # The reference (vLLM log-prob engine) still holds the base weights: it differs after a step.
    assert (reference - trained).abs().max() > 1e-4
