"""vLLM-specific behaviour: fused modules, streamed and failed loads, prefix cache, CPU sleep, one engine a process."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.installed import require_vllm

pytestmark = pytest.mark.vllm
require_vllm()

PROMPT = list(range(40, 140))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinySpec(family="qwen2"))


@pytest.fixture(scope="module")
def backend(model_path):
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    options = SamplingEngineOptions(
        device="cpu", max_model_len=512, block_size=32, extra={"kv_cache_memory_bytes": 128 << 20}
    )
    engine = VLLMBackend(str(model_path), options)
    yield engine
    engine.shutdown()


@pytest.fixture()
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def matches_hf(backend, hf_model) -> bool:
    """Greedy log-probs of the engine equal a plain HF forward on the same tokens."""
    completion = backend.generate([PROMPT], GREEDY)[0][0]
    ids = torch.tensor([PROMPT + completion.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(ids).logits[0], dim=-1)
    want = [logprobs[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)]
    return max(abs(g - w) for g, w in zip(completion.logprobs, want)) <= 1e-4


def scaled(hf_model, names: list[str], factor: float) -> list[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for name in names:
            hf_model.get_parameter(name).mul_(factor)
    return [(name, hf_model.get_parameter(name).detach().clone()) for name in names]


def test_vllm_reuses_cached_prompt_blocks_until_a_load_resets_them(backend, hf_model):
    backend.load_weights(hf_model.named_parameters())

    def cached() -> int:
        return backend.llm.generate([{"prompt_token_ids": PROMPT}], use_tqdm=False)[0].num_cached_tokens

    cached()
    assert cached() > 0
    backend.load_weights(hf_model.named_parameters())
    assert cached() == 0


def test_a_load_may_replace_whole_modules_only(backend, hf_model):
    qkv = [f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")]
    backend.load_weights(scaled(hf_model, ["model.layers.1.mlp.down_proj.weight", *qkv], 1.3))

    assert matches_hf(backend, hf_model)


def test_parts_of_a_fused_module_wait_for_the_rest_before_reaching_vllm(backend, hf_model):
    backend.load_weights(hf_model.named_parameters())
    q, k, v = ([f"model.layers.0.self_attn.{p}_proj.{kind}" for kind in ("weight", "bias")] for p in "qkv")

    backend.load_weights(scaled(hf_model, q, 2.0))
    with pytest.raises(RuntimeError, match=r"incomplete.*k_proj\.bias"):
        backend.generate([PROMPT], GREEDY)

    backend.load_weights(scaled(hf_model, k + v, 2.0))
    assert matches_hf(backend, hf_model)


def test_a_sync_streamed_in_buckets_that_split_fused_modules_lands_whole(backend, hf_model):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.mul_(0.9).add_(0.01 * torch.randn(param.shape, generator=gen))
    named = [(name, param.detach().clone()) for name, param in hf_model.named_parameters()]
    norm = sum(float(t.double().pow(2).sum()) for _, t in named) ** 0.5

    for start in range(0, len(named), 4):  # buckets of 4 tensors cut q/k/v and gate/up apart
        bucket = named[start : start + 4]
        backend.load_weights(bucket)
        for _, tensor in bucket:
            tensor.zero_()  # the sync reuses its bucket buffers

    assert backend.weight_norm() == pytest.approx(norm, rel=1e-9)
    assert matches_hf(backend, hf_model)


def test_a_failed_load_blocks_generation_until_a_full_load(backend, hf_model):
    with pytest.raises(ValueError, match="not_a_weight"):
        backend.load_weights([("model.layers.0.not_a_weight", torch.zeros(4))])
    with pytest.raises(RuntimeError, match="no usable weights"):
        backend.generate([PROMPT], GREEDY)

    backend.load_weights(hf_model.named_parameters())
    assert matches_hf(backend, hf_model)


def test_sleep_on_cpu_answers_that_vllm_sleep_mode_needs_cuda(backend):
    before = backend.generate([PROMPT], GREEDY)[0][0].token_ids

    for level in (1, 2):
        answer = backend.sleep(level)
        assert answer["slept"] is False and "needs CUDA" in answer["reason"]
    assert backend.wake(None)["woke"] is False
    assert backend.generate([PROMPT], GREEDY)[0][0].token_ids == before
    with pytest.raises(ValueError, match="sleep level"):
        backend.sleep(3)
    with pytest.raises(ValueError, match="wake tags"):
        backend.wake(["everything"])


def test_an_empty_prompt_is_rejected_by_index(backend):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]"):
        backend.generate([PROMPT, []], GREEDY)


def test_a_prompt_without_room_for_one_token_is_rejected_by_index(backend):
    # max_model_len is 512: a prompt of 512 tokens leaves no room for the completion.
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] has 512 tokens; expected at most 511"):
        backend.generate([PROMPT, list(range(512))], GREEDY)


def test_a_token_id_outside_the_vocabulary_is_rejected_by_index(backend):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] holds \[5000, -1\]; expected ints in \[0, 1024\)"):
        backend.generate([PROMPT, [5, 5000, 6, -1]], GREEDY)


def test_a_stop_token_id_outside_the_vocabulary_is_the_native_engines_value_error(backend):
    with pytest.raises(ValueError, match=r"stop_token_ids holds \[1024, -2\]; expected ints in \[0, 1024\)"):
        backend.generate([PROMPT], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5, 1024, -2]))


def test_sampling_params_vllm_refuses_are_a_value_error_naming_the_field(backend):
    # vLLM's VLLMValidationError is no ValueError: left as it is, the server answers 500, not 400.
    with pytest.raises(ValueError, match=r"sampling_params.temperature=3.0: .*\[0, 2\]"):
        backend.generate([PROMPT], SamplingParams(temperature=3.0))


def test_a_second_engine_in_the_same_process_is_refused(backend, model_path):
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    with pytest.raises(RuntimeError, match="one per process"):
        VLLMBackend(str(model_path), backend.options)


def test_the_owning_process_keeps_control_of_torch_threads(backend):
    threads = torch.get_num_threads()
    wanted = 2 if threads == 1 else 1
    try:
        torch.set_num_threads(wanted)
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(threads)
