"""SkyRL's vLLM-style sampling params on arctic's sampler, and response text decoded from the sampled tokens."""

from __future__ import annotations

import pytest
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
from skyrl.train.config import SamplingParams as SkyRLSamplingParams

from arctic_rl_core.engines.sampling.protocol import SamplingParams
from arctic_rl_skyrl.inference_client import ArcticInferenceClient, arctic_sampling_params
from arctic_rl_skyrl.session import ArcticSession


def test_skyrl_default_sampling_params_are_valid_arctic_params():
    skyrl = get_vllm_sampling_params(SkyRLSamplingParams(max_generate_length=32, temperature=0.7, stop=["####"]))
    sampling, decoding = arctic_sampling_params(skyrl)
    params = SamplingParams.model_validate(sampling)
    assert (params.max_tokens, params.min_tokens, params.temperature, params.top_k, params.stop) == (
        32, 1, 0.7, -1, ["####"],
    )  # fmt: skip
    assert params.logprobs
    assert decoding == {"skip_special_tokens": True, "include_stop_str_in_output": True}


def test_logprobs_none_asks_arctic_for_no_logprobs():
    sampling, _ = arctic_sampling_params({"max_tokens": 4, "logprobs": None})
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


def test_response_text_is_the_decoded_tokens_without_special_tokens(client):
    ids = client.tokenizer("The answer is 42")["input_ids"] + [client.tokenizer.eos_token_id]
    text = client._text({"token_ids": ids, "stop_reason": None}, {"skip_special_tokens": True,
                                                                  "include_stop_str_in_output": True})  # fmt: skip
    assert text == "The answer is 42"


def test_stop_string_is_cut_unless_skyrl_asks_to_keep_it(client):
    ids = client.tokenizer("so 6 #### 6 more")["input_ids"]
    completion = {"token_ids": ids, "stop_reason": "####"}
    kept = client._text(completion, {"skip_special_tokens": True, "include_stop_str_in_output": True})
    cut = client._text(completion, {"skip_special_tokens": True, "include_stop_str_in_output": False})
    assert kept == "so 6 #### 6 more" and cut == "so 6 "


def test_openai_endpoints_are_refused_with_the_reason(client):
    with pytest.raises(NotImplementedError, match="no OpenAI-compatible endpoint"):
        client.get_endpoint_url()
