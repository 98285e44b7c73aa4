"""vllm_config.max_logprobs=-1 is vLLM's "no cap": the log-prob engine then takes any top_k up to the vocabulary."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions
from tests.installed import require_vllm

pytestmark = pytest.mark.vllm
require_vllm()


@pytest.fixture(scope="module")
def engine(tiny_model):
    from arctic_rl_core.engines.log_prob.vllm import VLLMLogProbEngine

    # The sampler's processed mode too: the log-prob engine's scores stay those of the raw logits.
    options = SamplingEngineOptions(
        device="cpu",
        max_model_len=512,
        logprobs_mode="processed_logprobs",
        extra={"kv_cache_memory_bytes": 128 << 20, "max_logprobs": -1},
    )
    log_prob_engine = VLLMLogProbEngine(tiny_model, options)
    yield log_prob_engine
    log_prob_engine.shutdown()


def test_without_a_cap_top_k_may_exceed_vllms_default_of_20(engine, tiny_model):
    ids = [9, 8, 7, 6, 5]

    out = engine.token_log_probs(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), top_k=50)

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    assert out["top_ids"].shape == (1, len(ids), 50)
    # Values, not ids: among 50 near-equal log-probs, ids of equal rank may swap between the two forwards.
    torch.testing.assert_close(out["top_log_probs"][0, 0], reference[0].topk(50).values, atol=1e-4, rtol=0)


def test_without_a_cap_top_k_beyond_the_vocabulary_is_rejected(engine):
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 1024\]"):
        engine.log_probs(["a b c"], None, top_k=1025)
