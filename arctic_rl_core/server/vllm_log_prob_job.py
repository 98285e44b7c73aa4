"""The vLLM log-prob job (``log_prob_engine="vllm"``): replicas of ``VLLMLogProbWorker``.

Sequences are scored by prefill with prompt log-probs; rows are spread over
replicas. vLLM gives no entropy and applies no logit post-processors here, so
a request for either is refused by name.
"""

from __future__ import annotations

import torch

from arctic_rl_core.engines.batching import RowBatch, contiguous_split
from arctic_rl_core.engines.log_prob.worker import VLLMLogProbWorker
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions
from arctic_rl_core.errors import BadRequest
from arctic_rl_core.ops import Batch, JobKind, Processing
from arctic_rl_core.server.jobs import Job, remote_worker

RemoteVLLMLogProbWorker = remote_worker(VLLMLogProbWorker)


class VLLMLogProbJob(Job):
    kind = JobKind.LOG_PROB

    def __init__(self, job_id, slots, threads, model_name: str, options: SamplingEngineOptions):
        super().__init__(job_id, slots, threads)
        self.model_name, self.options = model_name, options

    async def _create_workers(self) -> None:
        self.workers = [
            RemoteVLLMLogProbWorker.options(**slot.actor_options()).remote(
                replica, self.model_name, self.options, self.threads
            )
            for replica, slot in enumerate(self.slots)
        ]

    def _ranges(self, count: int) -> list[tuple[int, int]]:
        return contiguous_split([1] * count, len(self.workers))

    async def log_probs(self, prompts: list[str], completions: list[str] | None, top_k: int) -> list[dict]:
        ranges = [(a, b) for a, b in self._ranges(len(prompts)) if b > a]
        parts = await self.gather(
            [
                self.workers[i].log_probs.remote(
                    prompts[a:b], completions[a:b] if completions is not None else None, top_k
                )
                for i, (a, b) in enumerate(ranges)
            ]
        )
        return [entry for part in parts for entry in part]

    async def fwd_no_grad(self, batch: Batch, processing: Processing | None, return_entropy: bool, **_) -> dict:
        if return_entropy:
            raise BadRequest(
                "return_entropy: the vLLM log-prob engine computes no entropy; use log_prob_engine='deepspeed'"
            )
        if processing is not None and processing.post:
            raise BadRequest("processing.post: the vLLM log-prob engine applies no post-processors; use 'deepspeed'")
        rows = RowBatch(batch.input_ids.long(), batch.attention_mask)
        ranges = [(a, b) for a, b in self._ranges(rows.rows) if b > a]
        parts = await self.gather(
            [self.workers[i].token_log_probs.remote(rows.select(a, b), 0) for i, (a, b) in enumerate(ranges)]
        )
        return {"log_probs_shifted": torch.cat([p["log_probs_shifted"] for p in parts])}

    async def weight_norm(self) -> float:
        return (await self.call_all("weight_norm"))[0]

    async def sleep_log_prob(self) -> dict:
        return {"replicas": await self.call_all("sleep", 1)}

    async def wake_log_prob(self) -> dict:
        return {"replicas": await self.call_all("wake", None)}
