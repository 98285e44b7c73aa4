"""The sampling protocol: what every sampling backend (native, vLLM) offers.

A backend is an in-process object owned by one sampling worker (a Ray actor,
one per replica). The worker validates requests at the edge with
``SamplingParams`` and then trusts them; backends never see raw user dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Iterable, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FinishReason = Literal["stop", "length", "abort"]
# What ``Completion.logprobs`` score, in vLLM's names (its ``logprobs_mode``):
# "raw_logprobs", log-softmax of the model's logits, what the training engine computes at temperature 1;
# "processed_logprobs", log-softmax of the distribution the token was drawn from: logits / temperature over
# the tokens top-k, top-p and min_tokens leave (greedy rows: the logits over those min_tokens leaves).
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
# Below this temperature sampling is greedy, as vLLM's _SAMPLING_EPS: 1 / temperature would overflow float32.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(BaseModel):
    """Sampling parameters of one generate call; unknown keys are rejected by name."""

    model_config = ConfigDict(extra="forbid", strict=False)

    n: int = Field(1, ge=1, le=1024, description="Completions per prompt.")
    max_tokens: int = Field(16, ge=1, description="Maximum new tokens per completion.")
    min_tokens: int = Field(
        0, ge=0, description="Tokens before any may end the completion (EOS, stop_token_ids, a stop string's end)."
    )
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Below 1e-5 (0 too) means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables top-k.")
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, description="Non-empty stop strings; excluded from the returned text."
    )
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, description="Same seed, same prompt, same params: same completions.")
    logprobs: bool = Field(True, description="Return the log-prob of each sampled token.")

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data):
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _min_tokens_within_max_tokens(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; expected min_tokens <= max_tokens"
            )
        return self

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_in_vllms_form(cls, value):
        """vLLM's integer form too: 0 is the sampled token's log-prob (true here), null none (false)."""
        if value is None:
            return False
        if isinstance(value, int) and not isinstance(value, bool):
            if value == 0:
                return True
            raise ValueError(
                f"{value} asks for each token's top-{value} alternatives, which generate does not return; "
                "expected true, false, 0 (the sampled token's log-prob, as vLLM counts) or null"
            )
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def check_prompt(prompt: list[int], max_model_len: int, vocab_size: int, name: str = "prompt_token_ids") -> None:
    """A prompt every backend can serve: non-empty, room for one generated token, ids in the vocabulary."""
    if not prompt:
        raise ValueError(f"{name} is empty; expected at least one token")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"{name} has {len(prompt)} tokens; expected at most {max_model_len - 1}, so that one token fits "
            f"within max_model_len={max_model_len}"
        )
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} holds {bad[:4]}; expected ints in [0, {vocab_size})")


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Params every backend can serve on this model: stop ids in the vocabulary (the sampler bans them by
    index before ``min_tokens``; an id outside it would fail the whole batch's step)."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids holds {bad[:4]}; expected ints in [0, {vocab_size})")


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    # log p(token_i | prompt, tokens_<i), one per token in ``token_ids``: under the model's logits, or under
    # the processed sampling distribution when the engine's ``logprobs_mode`` is "processed_logprobs".
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | int | None = None

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


class SamplingEngineOptions(BaseModel):
    """Engine settings common to every backend, read from ``vllm_config`` / ``arctic_inference_config``.

    Keys a backend does not know stay in ``extra`` (vLLM passes them to its
    engine arguments; the native engine rejects them by name).
    """

    model_config = ConfigDict(extra="forbid")

    device: Literal["cuda", "cpu"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    max_model_len: int | None = Field(None, ge=16, description="Prompt + completion length limit; None: the model's.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences decoded together in one step.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0,
        description="This engine's share of device memory, for its weights, activations and KV cache (as in vLLM: "
        "what other processes, or this process before the engine started, hold is not counted in it).",
    )  # fmt: skip
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    use_fca: bool = Field(True, description="Forest Cascade Attention for decode batches that share prefixes.")
    tensor_parallel_size: int = Field(1, ge=1)
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="What Completion.logprobs score: the model's logits or the processed distribution."
    )
    extra: dict = Field(default_factory=dict, description="Backend-specific keys, passed through.")


class SamplingBackend(Protocol):
    """An inference engine one sampling worker drives, built as ``Backend(model_path, options)``."""

    def __init__(self, model_path: str, options: SamplingEngineOptions) -> None: ...

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace parameters by HF name; the prefix cache is stale afterwards."""

    def weight_norm(self) -> float:
        """L2 norm over all parameters, in float64, for sync checks."""

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int) -> dict:
        """Level 1 frees the KV cache; level 2 frees weights too. Returns what was freed."""

    def wake(self, tags: list[str] | None) -> dict:
        """Restore what ``sleep`` freed (``tags`` limits it to "weights" or "kv_cache")."""

    def shutdown(self) -> None: ...
