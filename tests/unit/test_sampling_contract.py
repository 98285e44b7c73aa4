"""The sampling protocol, as every backend (vLLM, native) must honour it, on a tiny real model on CPU.

One engine per backend serves the whole module (vLLM starts slowly on CPU).
Reference numbers come from a plain Hugging Face forward in float32.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.installed import require_vllm

# Mean |log p_engine - log p_hf| allowed per token (fp32 on both sides).
PARITY_MEAN_ABS = 1e-3
# A prompt that fills several KV-cache blocks, so the prefix cache holds it.
LONG_PROMPT = list(range(40, 140))
PROMPTS = [[5, 6, 7, 8, 9, 10], [300, 301, 302], LONG_PROMPT[:50]]


def _native_engine_class():
    from arctic_rl_core.engines.sampling.native import NativeEngine

    return NativeEngine


def _vllm_backend_class():
    require_vllm()
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    return VLLMBackend


ENGINES = {
    # vLLM's CPU attention wants KV blocks of 32 tokens; a small KV cache keeps the test light.
    "vllm": (_vllm_backend_class, {"block_size": 32, "extra": {"kv_cache_memory_bytes": 128 << 20}}),
    "native": (_native_engine_class, {}),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinySpec(family="qwen2"))


@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.vllm), "native"])
def engine(request, model_path):
    engine_class, settings = ENGINES[request.param]
    options = SamplingEngineOptions(device="cpu", dtype="float32", enforce_eager=True, max_model_len=512, **settings)
    backend = engine_class()(str(model_path), options)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_token_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) from a plain HF forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(completion)]


def perturbed_weights(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (param.detach() * 1.5 + 0.02 * torch.randn(param.shape, generator=gen)).contiguous()
        for name, param in model.named_parameters()
    }


def norm(weights: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(w.double().pow(2).sum()) for w in weights.values()))


def test_generate_returns_n_completions_per_prompt_in_prompt_order(engine):
    results = engine.generate(PROMPTS, SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=0))

    assert len(results) == len(PROMPTS)
    for completions in results:
        assert len(completions) == 3
        for c in completions:
            assert len(c.token_ids) == 5 and len(c.logprobs) == 5
            assert c.finish_reason == "length"
    # Prompt order is kept: each prompt alone gives what it gave in the batch.
    alone = engine.generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=0))
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in results[1]]


def test_greedy_decoding_with_n_above_one_returns_n_copies_of_the_greedy_completion(engine):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    results = engine.generate(PROMPTS[:2], greedy.model_copy(update={"n": 3}))

    for prompt, completions in zip(PROMPTS[:2], results):
        alone = engine.generate([prompt], greedy)[0][0]
        assert [(c.token_ids, c.text, c.finish_reason) for c in completions] == [
            (alone.token_ids, alone.text, alone.finish_reason)
        ] * 3
        assert all(len(c.logprobs) == len(c.token_ids) for c in completions)


def test_same_seed_reproduces_completions_and_another_seed_changes_them(engine):
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, ignore_eos=True, seed=7)

    first = engine.generate(PROMPTS[:2], params)
    again = engine.generate(PROMPTS[:2], params)
    other = engine.generate(PROMPTS[:2], params.model_copy(update={"seed": 8}))

    tokens = lambda results: [[c.token_ids for c in completions] for completions in results]  # noqa: E731
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)


@pytest.mark.parametrize("seed", [-1, 2**64 + 3])
def test_any_integer_seed_reproduces_its_completions(engine, seed):
    params = SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=seed)

    first = engine.generate([PROMPTS[0]], params)[0]
    again = engine.generate([PROMPTS[0]], params)[0]

    assert [c.token_ids for c in first] == [c.token_ids for c in again]


def test_neighbouring_seeds_share_no_completion(engine):
    # RL runs often seed by step; seed s's second completion must not be seed s+1's first.
    params = SamplingParams(n=2, max_tokens=6, ignore_eos=True)

    seen = [
        c.token_ids
        for seed in (7, 8)
        for c in engine.generate([PROMPTS[0]], params.model_copy(update={"seed": seed}))[0]
    ]

    assert len({tuple(ids) for ids in seen}) == 4


def test_stop_string_ends_the_completion_and_is_left_out_of_the_text(engine):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = engine.generate([PROMPTS[0]], greedy)[0][0]
    # A stop string from the middle of what greedy decoding writes anyway.
    candidates = (full.text[i : i + 2] for i in range(3, len(full.text) - 2))
    stop = next(s for s in candidates if s.isprintable() and s.strip() and "\ufffd" not in s)
    expected_text = full.text[: full.text.index(stop)]

    stopped = engine.generate([PROMPTS[0]], greedy.model_copy(update={"stop": [stop]}))[0][0]

    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stopped.text == expected_text
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_the_completion(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = engine.generate([PROMPTS[1]], greedy)[0][0]
    stop_token = full.token_ids[4]
    first_at = full.token_ids.index(stop_token)

    stopped = engine.generate([PROMPTS[1]], greedy.model_copy(update={"stop_token_ids": [stop_token]}))[0][0]

    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_token
    assert stopped.token_ids[:first_at] == full.token_ids[:first_at]
    assert len(stopped.token_ids) <= first_at + 1


def test_logprobs_are_finite_nonpositive_and_one_per_token(engine):
    results = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3))

    for completions in results:
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) > 0
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)


def test_logprobs_are_left_out_when_not_requested(engine):
    results = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, logprobs=False, ignore_eos=True))

    assert results[0][0].logprobs == []
    assert len(results[0][0].token_ids) == 4


def test_sampled_logprobs_match_a_hugging_face_forward_after_loading_weights(engine, hf_model, record_property):
    weights = perturbed_weights(hf_model, seed=1)
    engine.load_weights(weights.items())
    hf_model.load_state_dict(weights, strict=False)

    results = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))

    diffs = [
        abs(got - want)
        for prompt, completions in zip(PROMPTS, results)
        for c in completions
        for got, want in zip(c.logprobs, hf_token_logprobs(hf_model, prompt, c.token_ids))
    ]
    record_property("logprob_max_abs_diff", max(diffs))
    print(f"sampled log-probs vs HF: mean abs diff {sum(diffs) / len(diffs):.2e}, max {max(diffs):.2e}")
    assert sum(diffs) / len(diffs) <= PARITY_MEAN_ABS


def test_weight_norm_equals_the_norm_of_the_loaded_weights(engine, hf_model):
    weights = perturbed_weights(hf_model, seed=2)

    engine.load_weights(weights.items())

    assert engine.weight_norm() == pytest.approx(norm(weights), rel=1e-9)


def test_loading_weights_resets_the_prefix_cache(engine, hf_model):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.load_weights(perturbed_weights(hf_model, seed=3).items())
    engine.generate([LONG_PROMPT], greedy)  # the prompt's KV, under these weights, is now cached

    new_weights = perturbed_weights(hf_model, seed=4)
    engine.load_weights(new_weights.items())
    hf_model.load_state_dict(new_weights, strict=False)
    after = engine.generate([LONG_PROMPT], greedy)[0][0]

    # Stale cached KV from the old weights would shift every log-prob.
    want = hf_token_logprobs(hf_model, LONG_PROMPT, after.token_ids)
    assert max(abs(g - w) for g, w in zip(after.logprobs, want)) <= 1e-3


def test_reset_prefix_cache_can_be_called_between_generations(engine):
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = engine.generate([LONG_PROMPT], greedy)[0][0]

    engine.reset_prefix_cache()

    assert engine.generate([LONG_PROMPT], greedy)[0][0].token_ids == before.token_ids


def test_logprobs_takes_vllms_integer_form_without_inverting_it():
    # In vLLM, logprobs=0 returns the sampled token's log-prob; as a plain bool it would have turned them off.
    assert SamplingParams(logprobs=0).logprobs is True
    assert SamplingParams(logprobs=None).logprobs is False
    assert SamplingParams(logprobs=False).logprobs is False
    with pytest.raises(ValueError, match=r"logprobs\n.*5 asks for each token's top-5 alternatives"):
        SamplingParams(logprobs=5)


def test_min_tokens_above_max_tokens_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"min_tokens=5 exceeds max_tokens=2"):
        SamplingParams(max_tokens=2, min_tokens=5)
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
