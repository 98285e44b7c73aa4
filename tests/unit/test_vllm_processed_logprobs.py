"""vllm_config.logprobs_mode="processed_logprobs" on the vLLM backend: log-probs of the filtered, scaled distribution.

Its own module: vLLM runs one engine per process, and this one is built in a
mode the other vLLM modules' engines are not.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from tests.installed import require_vllm
from tests.sampling_reference import processed_logprobs

pytestmark = pytest.mark.vllm
require_vllm()

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300]]


@pytest.fixture(scope="module")
def backend(tiny_model):
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    options = SamplingEngineOptions(
        device="cpu",
        max_model_len=512,
        block_size=32,
        logprobs_mode="processed_logprobs",
        extra={"kv_cache_memory_bytes": 128 << 20},
    )
    engine = VLLMBackend(str(tiny_model), options)
    yield engine
    engine.shutdown()


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(backend, tiny_model):
    params = SamplingParams(n=2, max_tokens=8, temperature=0.7, top_k=20, top_p=0.8, seed=3, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for prompt, request in zip(PROMPTS, backend.generate(PROMPTS, params), strict=True):
        for completion in request:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + completion.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
            expected = processed_logprobs(logits, completion.token_ids, 0.7, 20, 0.8)
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
