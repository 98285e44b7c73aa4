"""SkyRL's vLLM-style sampling params on arctic's sampler, and response text decoded from the sampled tokens."""

from __future__ import annotations

import asyncio

import pytest
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
from skyrl.train.config import SamplingParams as SkyRLSamplingParams

from arctic_rl_core.engines.sampling.protocol import SamplingParams
from arctic_rl_skyrl.inference_client import ArcticInferenceClient, arctic_sampling_params
from arctic_rl_skyrl.session import ArcticSession


def test_skyrl_default_sampling_params_are_valid_arctic_params():
    skyrl = get_vllm_sampling_params(SkyRLSamplingParams(max_generate_length=32, temperature=0.7, stop=["####"]))
    sampling = arctic_sampling_params(skyrl)
    params = SamplingParams.model_validate(sampling)
    assert (params.max_tokens, params.min_tokens, params.temperature, params.top_k, params.stop) == (
        32, 1, 0.7, -1, ["####"],
    )  # fmt: skip
    assert params.logprobs
    # vLLM's text options: SkyRL's client decodes the token ids itself, so they change nothing here.
    assert {"skip_special_tokens", "include_stop_str_in_output"}.isdisjoint(sampling)


def test_logprobs_none_asks_arctic_for_no_logprobs():
    sampling = arctic_sampling_params({"max_tokens": 4, "logprobs": None})
    assert sampling == {"max_tokens": 4, "logprobs": False}


def test_min_p_is_refused_by_name():
    with pytest.raises(ValueError, match="min_p=0.1"):
        arctic_sampling_params({"max_tokens": 4, "min_p": 0.1})


def test_unknown_sampling_params_are_refused_by_name():
    with pytest.raises(ValueError, match=r"\['frequency_penalty'\]"):
        arctic_sampling_params({"max_tokens": 4, "frequency_penalty": 0.5})


@pytest.fixture
def client(tiny_model):
    from transformers import AutoTokenizer

    session = ArcticSession()
    yield ArcticInferenceClient(
        session, AutoTokenizer.from_pretrained(tiny_model), model_name=tiny_model, sampling_gpus=1, colocated=False
    )
    session.close()


class SamplerSession:
    """Stands in for the arctic session: every generate returns the same completion."""

    def __init__(self, completion: dict):
        self.completion = completion
        self.requests = []

    async def acall(self, method):
        return await method(self)

    async def generate(self, prompt_token_ids, sampling_params):
        self.requests.append(sampling_params)
        return [{"outputs": [dict(self.completion)]} for _ in prompt_token_ids]


def generate(tokenizer, completion: dict, **decoding) -> tuple[SamplerSession, dict]:
    session = SamplerSession(completion)
    client = ArcticInferenceClient(session, tokenizer, model_name="tiny", sampling_gpus=1, colocated=False)
    params = {"max_tokens": 8, "logprobs": None, **decoding}
    output = asyncio.run(client.generate({"prompt_token_ids": [[5, 6], [7]], "sampling_params": params}))
    return session, output


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_response_text_is_skyrls_batch_decode_of_the_tokens_special_tokens_kept(tiny_model, skip_special_tokens):
    """SkyRL 0.4's RemoteInferenceClient decodes with ``tokenizer.batch_decode(ids)``, whatever the sampling params."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer("The answer is 42", add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    completion = {"token_ids": ids, "finish_reason": "stop", "stop_reason": None}
    session, output = generate(tokenizer, completion, skip_special_tokens=skip_special_tokens)
    assert output["responses"] == tokenizer.batch_decode([ids, ids]) == ["The answer is 42<|im_end|>"] * 2
    assert output["response_ids"] == [ids, ids] and output["stop_reasons"] == ["stop", "stop"]
    assert "skip_special_tokens" not in session.requests[0]


@pytest.mark.parametrize("include_stop_str_in_output", [True, False])
def test_stop_string_stays_in_the_text_as_in_skyrl(tiny_model, include_stop_str_in_output):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer("so 6 #### 6", add_special_tokens=False)["input_ids"]
    completion = {"token_ids": ids, "finish_reason": "stop", "stop_reason": "####"}
    _, output = generate(tokenizer, completion, include_stop_str_in_output=include_stop_str_in_output)
    assert output["responses"] == tokenizer.batch_decode([ids, ids]) == ["so 6 #### 6"] * 2


def test_openai_endpoints_are_refused_with_the_reason(client):
    with pytest.raises(NotImplementedError, match="no OpenAI-compatible endpoint"):
        client.get_endpoint_url()
