"""``ArcticInferenceClient``: SkyRL's inference-engine interface over arctic-rl's sampling engine.

SkyRL's generators (``SkyRLGymGenerator`` among them) sample through an
``InferenceEngineInterface``; this one sends their token-in/token-out requests
to the arctic sampling job, so rollouts, environments and rewards stay
SkyRL's own while the sampler is arctic's. Weights reach the sampler through
the trainer's dispatch (``sync_weights``), never through this client.

vLLM-style sampling params map one to one onto arctic's; ``min_p`` and keys
arctic does not know are refused by name. ``generator.batched=true`` sends a
whole batch in one call; the multi-turn agent loop sends one call per turn.

The response text is ``tokenizer.batch_decode(response_ids)``, as SkyRL 0.4's
``RemoteInferenceClient`` makes it: special tokens and stop strings stay in.
``skip_special_tokens`` and ``include_stop_str_in_output`` only shape vLLM's
own text, which that client never reads, so they are accepted and dropped.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Tuple

from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

from arctic_rl_skyrl.session import ArcticSession

# vLLM sampling params arctic's sampler takes as they are.
_PASSED_THROUGH = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                   "ignore_eos", "seed")  # fmt: skip
# vLLM params for vLLM's detokenized text, which SkyRL's client discards (it decodes the token ids itself).
_VLLM_TEXT_ONLY = ("skip_special_tokens", "include_stop_str_in_output")


def arctic_sampling_params(params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """vLLM-style ``params`` as arctic's sampling params; refuses, by name, what arctic's sampler cannot do."""
    params = {key: value for key, value in (params or {}).items() if key not in _VLLM_TEXT_ONLY}
    min_p = params.pop("min_p", 0.0)
    if min_p:
        raise ValueError(f"sampling param min_p={min_p!r} is not supported by arctic's sampler; use top_p or top_k")
    logprobs = params.pop("logprobs", None)
    unknown = sorted(set(params) - set(_PASSED_THROUGH))
    if unknown:
        raise ValueError(
            f"sampling params {unknown} are not supported by arctic's sampler; it takes {', '.join(_PASSED_THROUGH)}, "
            "logprobs, min_p=0, skip_special_tokens, include_stop_str_in_output"
        )
    sampling = {key: value for key, value in params.items() if value is not None}
    if sampling.get("n", 1) != 1:
        raise ValueError(f"sampling param n={sampling['n']!r}: SkyRL repeats prompts itself; expected n=1")
    sampling["logprobs"] = logprobs is not None
    return sampling


class ArcticInferenceClient(InferenceEngineInterface):
    """Generation on the arctic sampling job; sleep and wake when the engines share devices."""

    def __init__(self, session: ArcticSession, tokenizer, model_name: str, sampling_gpus: int, colocated: bool):
        self.session = session
        self.tokenizer = tokenizer
        self._model_name = model_name
        self.sampling_gpus = sampling_gpus
        self.colocated = colocated

    @property
    def model_name(self) -> str:
        return self._model_name

    async def generate(self, input_batch: InferenceEngineInput, model: Optional[str] = None) -> InferenceEngineOutput:
        prompt_token_ids = input_batch.get("prompt_token_ids")
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenizer.apply_chat_template(
                input_batch["prompts"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        sampling = arctic_sampling_params(input_batch.get("sampling_params"))
        results = await self.session.acall(
            lambda client: client.generate(prompt_token_ids=prompt_token_ids, sampling_params=sampling)
        )
        completions = [result["outputs"][0] for result in results]
        response_ids = [list(c["token_ids"]) for c in completions]
        return InferenceEngineOutput(
            # SkyRL's RemoteInferenceClient.detokenize: special tokens and stop strings kept.
            responses=self.tokenizer.batch_decode(response_ids),
            response_ids=response_ids,
            stop_reasons=[c["finish_reason"] for c in completions],
            response_logprobs=[list(c["logprobs"]) for c in completions] if sampling["logprobs"] else None,
            prompt_logprobs=None,
            rollout_expert_indices=None,
            rollout_sample_support=None,
        )

    # ------------------------------------------------------------ devices

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """Colocated, free the sampler's memory for training (weights come back with the next sync)."""
        if self.colocated:
            await self.session.acall(lambda client: client.sleep_inference(level=1))

    async def wake_up(self, *args: Any, tags: Optional[List[str]] = None, **kwargs: Any) -> None:
        if self.colocated:
            await self.session.acall(lambda client: client.wake_inference(tags=tags))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await self.session.acall(lambda client: client.reset_prefix_cache())

    async def pause_generation(self) -> None:
        """Nothing to pause: the arctic sampling job holds generation off while it loads weights."""

    async def resume_generation(self) -> None:
        """Nothing to resume: see :meth:`pause_generation`."""

    async def finish_session(self, session_id: Hashable) -> None:
        """arctic's sampler keeps no per-session state; there is nothing to release."""

    async def get_world_size(self) -> Tuple[int, int]:
        return self.sampling_gpus, 1

    async def teardown(self) -> None:
        """The run's ``ArcticSession`` owns the arctic jobs and shuts them down; this client holds nothing."""

    # ------------------------------------------------------------ not offered by arctic-rl

    async def update_named_weights(self, request: Any) -> None:
        raise NotImplementedError("arctic-rl moves weights with the trainer's sync_weights, not through the sampler")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> Dict[str, Any]:
        raise NotImplementedError("arctic-rl trains full weights; LoRA adapters are not supported")

    def get_endpoint_url(self) -> str:
        raise NotImplementedError(_NO_OPENAI_ENDPOINT)

    async def chat_completion(self, request_payload: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(_NO_OPENAI_ENDPOINT)

    async def render_chat_completion(self, request_payload: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(_NO_OPENAI_ENDPOINT)

    async def completion(self, request_payload: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(_NO_OPENAI_ENDPOINT)


_NO_OPENAI_ENDPOINT = (
    "arctic-rl serves no OpenAI-compatible endpoint; use a generator that samples token ids "
    "(SkyRLGymGenerator), not one that calls chat/completions"
)
