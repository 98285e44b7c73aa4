"""log_prob_engine="vllm": scores of given tokens equal a plain Hugging Face forward, in both layouts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.installed import require_vllm

pytestmark = pytest.mark.vllm
require_vllm()

TOL = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinySpec(family="qwen2"))


@pytest.fixture(scope="module")
def engine(model_path):
    from arctic_rl_core.engines.log_prob.vllm import VLLMLogProbEngine

    options = SamplingEngineOptions(device="cpu", max_model_len=512, extra={"kv_cache_memory_bytes": 128 << 20})
    log_prob_engine = VLLMLogProbEngine(str(model_path), options)
    yield log_prob_engine
    log_prob_engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row t is the distribution of token t+1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)


def test_completion_tokens_are_scored_given_their_prompt_with_sorted_top_k(engine, hf_model, tokenizer):
    prompts = ["What is 12 + 7? The answer is", "SELECT name FROM t1"]
    completions = [" 19. #### 19", " WHERE id > 3;"]

    results = engine.log_probs(prompts, completions, top_k=3)

    for prompt, completion, result in zip(prompts, completions, results):
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        assert result["prompt_token_ids"] == prompt_ids
        assert result["token_ids"] == result["completion_token_ids"] == completion_ids
        reference = hf_log_softmax(hf_model, prompt_ids + completion_ids)
        scored = zip(completion_ids, result["token_log_probs"], result["top_log_probs"])
        for i, (token, logprob, top) in enumerate(scored):
            row = reference[len(prompt_ids) - 1 + i]
            assert logprob == pytest.approx(row[token].item(), abs=TOL)
            assert [t for t, _ in top] == row.topk(3).indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(row.topk(3).values.tolist(), abs=TOL)


def test_without_completions_every_prompt_token_after_the_first_is_scored(engine, hf_model, tokenizer):
    prompt = "the answer is 42 because of the question"
    ids = tokenizer(prompt)["input_ids"]

    (result,) = engine.log_probs([prompt], None, top_k=0)

    reference = hf_log_softmax(hf_model, ids)
    assert result["token_ids"] == ids[1:]
    assert "top_log_probs" not in result
    want = [reference[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
    assert result["token_log_probs"] == pytest.approx(want, abs=TOL)


def test_shifted_layout_matches_hf_for_left_and_right_padded_rows(engine, hf_model):
    rows = [[5, 6, 7, 8, 9, 10, 11], [300, 301, 302, 303], [700]]
    length = 9
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    starts = [0, length - len(rows[1]), 2]  # right-padded, left-padded, a single token in the middle
    for row, (ids, start) in enumerate(zip(rows, starts)):
        input_ids[row, start : start + len(ids)] = torch.tensor(ids)
        attention_mask[row, start : start + len(ids)] = 1

    out = engine.token_log_probs(input_ids, attention_mask, top_k=2)

    assert out["log_probs_shifted"].shape == (3, length)
    assert out["top_ids"].shape == out["top_log_probs"].shape == (3, length, 2)
    for row, (ids, start) in enumerate(zip(rows, starts)):
        want = torch.zeros(length)
        reference = hf_log_softmax(hf_model, ids)
        for t in range(len(ids) - 1):
            want[start + t] = reference[t, ids[t + 1]]
        torch.testing.assert_close(out["log_probs_shifted"][row], want, atol=TOL, rtol=0)
        if len(ids) > 1:
            assert out["top_ids"][row, start].tolist() == reference[0].topk(2).indices.tolist()


def test_loaded_weights_change_the_scores(engine, hf_model):
    gen = torch.Generator().manual_seed(0)
    weights = {n: p.detach() * 1.2 + 0.01 * torch.randn(p.shape, generator=gen) for n, p in hf_model.named_parameters()}
    engine.load_weights(weights.items())
    hf_model.load_state_dict(weights, strict=False)
    ids = [9, 8, 7, 6, 5, 4, 3]

    out = engine.token_log_probs(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))

    reference = hf_log_softmax(hf_model, ids)
    want = torch.tensor([reference[t, ids[t + 1]].item() for t in range(len(ids) - 1)] + [0.0])
    torch.testing.assert_close(out["log_probs_shifted"][0], want, atol=TOL, rtol=0)


def test_top_k_beyond_vllm_max_logprobs_is_rejected(engine):
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.log_probs(["a b c"], None, top_k=10_000)


def test_attention_mask_with_a_hole_is_rejected(engine):
    with pytest.raises(ValueError, match="attention_mask row 0"):
        engine.token_log_probs(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 0, 1]]))


def test_completions_must_pair_with_prompts(engine):
    with pytest.raises(ValueError, match="completions has 1 entries for 2 prompts"):
        engine.log_probs(["a", "b"], ["c"])


def test_a_sequence_without_room_for_vllms_one_generated_token_is_rejected(engine):
    # vLLM scores a sequence by prefilling it and generating one token, so max_model_len (512) must exceed it.
    ids = torch.arange(512).reshape(1, 512) % 1000
    with pytest.raises(ValueError, match=r"token_ids\[0\] has 512 tokens; expected at most 511"):
        engine.token_log_probs(ids, torch.ones_like(ids))


def test_a_token_id_outside_the_vocabulary_is_a_value_error(engine):
    with pytest.raises(ValueError, match=r"holds \[4096\]; expected ints in \[0, 1024\)"):
        engine.token_log_probs(torch.tensor([[5, 4096, 7]]), torch.ones(1, 3, dtype=torch.long))
