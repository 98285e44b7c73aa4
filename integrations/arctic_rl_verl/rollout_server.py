"""The arctic rollout replica: verl's token-in/token-out ``generate`` served by arctic-rl's sampler.

verl's agent loops send one request per sampled sequence, concurrently
(``rollout.n`` of them per prompt). arctic-rl's ``generate`` samples a batch
of prompts in one call, so the server gathers the requests that arrive within
``batch_window_s`` of each other into one call per sampling configuration,
asking once with ``n = k`` for a prompt that ``k`` requests share: the sampler
then sees the whole group at once and computes the shared prompt once.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from arctic_rl_core import create_arctic_rl_client
from arctic_rl_verl.rollout import server_name
from arctic_rl_verl.session import RolloutHandoff, handoff_of

# verl's sampling keys that map one to one onto arctic-rl's SamplingParams.
_SAME_KEYS = ("temperature", "top_p", "top_k", "ignore_eos", "seed", "min_tokens", "stop", "stop_token_ids")


def arctic_sampling_params(requested: dict[str, Any], prompt_length: int, config) -> dict[str, Any]:
    """arctic-rl SamplingParams (n = 1) for one verl request; verl's ``config`` bounds the response length.

    Unknown keys are refused by name rather than ignored: each changes what is sampled.
    """
    params = dict(requested)
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
    if max_tokens is None:
        max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_length)
    if config.max_model_len is not None:
        max_tokens = min(max_tokens, config.max_model_len - prompt_length)
    penalty = params.pop("repetition_penalty", 1.0)
    if penalty != 1.0:
        raise ValueError(f"sampling_params.repetition_penalty={penalty}: the arctic sampler supports only 1.0")
    out = {"n": 1, "max_tokens": max(1, int(max_tokens)), "logprobs": bool(params.pop("logprobs", False))}
    out["ignore_eos"] = params.pop("ignore_eos", config.ignore_eos)
    if config.full_determinism:
        params.setdefault("seed", config.seed)
    for key in _SAME_KEYS:
        if key in params:
            out[key] = params.pop(key)
    if params:
        raise ValueError(f"sampling_params {sorted(params)} are not supported by the arctic sampler")
    return out


@dataclass
class _Request:
    prompt_ids: list[int]
    params: dict[str, Any]
    result: asyncio.Future


@dataclass
class _Group:
    """Requests with the same sampling params, one arctic generate call; equal prompts become one with n = k."""

    params: dict[str, Any]
    by_prompt: dict[tuple[int, ...], list[_Request]] = field(default_factory=lambda: defaultdict(list))


class ArcticRolloutServer:
    """One replica's server actor: what verl's LLMServerClient and RolloutReplica call."""

    def __init__(self, handoff: RolloutHandoff, rollout_config, replica_rank: int):
        self.handoff = handoff
        self.config = rollout_config
        self.replica_rank = replica_rank
        self.client = create_arctic_rl_client(handoff.client_config)
        self.global_steps = 0
        self._queue: list[_Request] = []
        self._arrived: Optional[asyncio.Event] = None
        self._dispatcher: Optional[asyncio.Task] = None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError("the arctic sampler takes text prompts only; got multimodal data")
        prompt_ids = [int(t) for t in prompt_ids]
        params = arctic_sampling_params(sampling_params, len(prompt_ids), self.config)
        request = _Request(prompt_ids, params, asyncio.get_running_loop().create_future())
        self._enqueue(request)
        completion = await request.result
        finish = completion["finish_reason"]
        return TokenOutput(
            token_ids=completion["token_ids"],
            log_probs=completion["logprobs"] if params["logprobs"] else None,
            stop_reason="aborted" if finish == "abort" else "completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _enqueue(self, request: _Request) -> None:
        if self._arrived is None:
            self._arrived = asyncio.Event()
        self._queue.append(request)
        self._arrived.set()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.ensure_future(self._dispatch())

    async def _dispatch(self) -> None:
        """Send what has queued once no request arrived for ``batch_window_s`` (or the sampler's batch is full)."""
        while self._queue:
            while len(self._queue) < self.config.max_num_seqs:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), self.handoff.batch_window_s)
                except asyncio.TimeoutError:
                    break
            batch, self._queue = self._queue, []
            groups: dict[tuple, _Group] = {}
            for request in batch:
                key = tuple(sorted((k, str(v)) for k, v in request.params.items()))
                group = groups.setdefault(key, _Group(request.params))
                group.by_prompt[tuple(request.prompt_ids)].append(request)
            await asyncio.gather(*[self._generate_group(group) for group in groups.values()])

    async def _generate_group(self, group: _Group) -> None:
        """One arctic generate call per multiplicity k: prompts that k requests share are asked with n = k."""
        by_count: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        for prompt, requests in group.by_prompt.items():
            by_count[len(requests)].append(prompt)
        for count, prompts in by_count.items():
            waiting = [request for prompt in prompts for request in group.by_prompt[prompt]]
            try:
                results = await self.client.generate(
                    prompt_token_ids=[list(p) for p in prompts], sampling_params={**group.params, "n": count}
                )
                for prompt, result in zip(prompts, results, strict=True):
                    for request, completion in zip(group.by_prompt[prompt], result["outputs"], strict=True):
                        request.result.set_result(completion)
            except Exception as exc:  # noqa: BLE001 - every waiting request must see the failure
                for request in waiting:
                    if not request.result.done():
                        request.result.set_exception(exc)

    async def set_global_steps(self, global_steps: int) -> None:
        """The training step whose weights the sampler holds (verl tags trajectories with it)."""
        self.global_steps = global_steps

    async def sleep(self) -> None:
        if self.handoff.sleeps_inference:
            await self.client.sleep_inference(level=1)

    async def wake_up(self) -> None:
        if self.handoff.sleeps_inference:
            await self.client.wake_inference()

    async def clear_kv_cache(self) -> None:
        await self.client.reset_prefix_cache()


class ArcticReplica(RolloutReplica):
    """verl's rollout replica for ``rollout.name=arctic``: one server actor, fed by the actor worker's session."""

    async def launch_servers(self):
        if len(self.workers) != 1:
            raise ValueError(
                f"the arctic rollout replica expects one verl worker, got {len(self.workers)}: set "
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1 and trainer.n_gpus_per_node=1"
            )
        handoff = await self.workers[0].__ray_call__.remote(handoff_of)
        server = (
            ray.remote(ArcticRolloutServer)
            .options(name=server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(handoff, self.config, self.replica_rank)
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"arctic-rl/replica-{self.replica_rank}"
