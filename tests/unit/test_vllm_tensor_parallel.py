"""tensor_parallel_size=2 on CPU: weights reach both ranks, and the norm counts replicated tensors once.

The tiny model has one key/value head for two ranks, so vLLM replicates it:
the norm must still equal the Hugging Face model's.
"""

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.installed import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
require_vllm()

CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinySpec(family="qwen2"))


@pytest.fixture(scope="module")
def backend(model_path):
    if len(CPUS) < 2:
        pytest.skip("tensor parallelism on CPU needs two CPUs, one per rank")
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    options = SamplingEngineOptions(
        device="cpu", max_model_len=256, block_size=32, tensor_parallel_size=2,
        extra={"kv_cache_memory_bytes": 64 << 20},
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        # One CPU per rank: vLLM's automatic binding wants a NUMA node per rank.
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CPUS[0]}|{CPUS[1]}")
        engine = VLLMBackend(str(model_path), options)
    yield engine
    engine.shutdown()


def test_weight_norm_across_two_ranks_equals_the_hf_norm_before_and_after_a_load(backend, model_path):
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    norm = lambda tensors: math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))  # noqa: E731
    assert backend.weight_norm() == pytest.approx(norm(hf.parameters()), rel=1e-9)

    gen = torch.Generator().manual_seed(0)
    weights = {n: p.detach() * 1.3 + 0.01 * torch.randn(p.shape, generator=gen) for n, p in hf.named_parameters()}
    backend.load_weights(weights.items())

    assert backend.weight_norm() == pytest.approx(norm(weights.values()), rel=1e-9)
    hf.load_state_dict(weights, strict=False)
    prompt = list(range(40, 100))
    completion = backend.generate([prompt], SamplingParams(max_tokens=6, seed=1, ignore_eos=True))[0][0]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt + completion.token_ids])).logits[0], dim=-1)
    want = [reference[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)]
    assert completion.logprobs == pytest.approx(want, abs=1e-4)
