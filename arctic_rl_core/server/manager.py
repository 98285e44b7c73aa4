"""The JobManager: creates, serves and destroys jobs; both servers (HTTP and Ray) sit on one.

``dispatch`` is the second hop of every operation: it resolves the request's
routing fields to jobs, takes their locks, and calls the job method named
like the op. Calls to one DeepSpeed job are serialized (a second call waits
for the first); sampling jobs run generate calls concurrently and serialize
weight loads, sleep and wake against them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from typing import Any, Callable

from pydantic import ValidationError

from arctic_rl_core.config import ArcticRLClientConfig, TrainingConfig, WeightSyncConfig
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions
from arctic_rl_core.engines.training.worker import WorkerSpec
from arctic_rl_core.errors import BadRequest, NotFound, validation_message
from arctic_rl_core.ops import JobKind, Op, Processing
from arctic_rl_core.server import placement
from arctic_rl_core.server.deepspeed_jobs import DeepSpeedJob, LogProbJob, TrainingJob
from arctic_rl_core.server.jobs import Job
from arctic_rl_core.server.sampling_job import SamplingJob

logger = logging.getLogger(__name__)

# Dotted loss paths the server may import besides the registry; operators widen it at startup only.
DEFAULT_ALLOWED_LOSS_PREFIXES = ("arctic_rl_core.processors.",)

# vllm_config keys the sampling options understand, and their spelling there.
_SAMPLING_KEYS = {
    "max_seq_len": "max_model_len",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "enforce_eager": "enforce_eager",
    "tensor_parallel_size": "tensor_parallel_size",
    "dtype": "dtype",
    "logprobs_mode": "logprobs_mode",
}


class JobManager:
    def __init__(
        self,
        device: str,
        allowed_loss_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_LOSS_PREFIXES,
        on_stop: Callable[[], Any] | None = None,
    ):
        self.device = device
        self.allowed_loss_prefixes = tuple(allowed_loss_prefixes)
        self.jobs: dict[int, Job] = {}
        self._next_id = 0
        self._locks: dict[int, asyncio.Lock] = {}
        self._starts: list[asyncio.Task] = []
        self._on_stop = on_stop
        self.served: dict[str, int] = {}

    # ------------------------------------------------------------ server ops

    async def initialize(self, config: ArcticRLClientConfig) -> dict:
        """Create the jobs the config asks for (sampling, log-prob, training) and start them in that order."""
        counts = {
            JobKind.SAMPLING: config.sampling_gpus,
            JobKind.LOG_PROB: config.log_prob_gpus,
            JobKind.TRAINING: config.training_gpus,
        }
        wanted = {kind: n for kind, n in counts.items() if n > 0}
        if not wanted:
            raise BadRequest("initialize: at least one of training_gpus, sampling_gpus, log_prob_gpus must be > 0")
        device = self._device(config.device)
        placement.check_capacity(placement.gpus_needed(list(wanted.values()), config.colocate))
        threads = max(1, (os.cpu_count() or 1) // sum(wanted.values())) if device == "cpu" else None
        # Every job's settings are checked before any GPU is reserved: a bad training_config must not strand them.
        builders = {kind: self._builder(kind, config, device) for kind in wanted}
        slots = await self._place(wanted, config.colocate, config.job_ready_timeout)
        jobs: list[Job] = []
        for kind, build in builders.items():
            job_id = self._next_id
            self._next_id += 1
            job = build(job_id, slots[kind], threads)
            job.on_release = slots["release"][kind]
            self.jobs[job_id] = job
            self._locks[job_id] = asyncio.Lock()
            jobs.append(job)
        self._starts.append(asyncio.ensure_future(self._start_in_order(jobs)))
        return {kind.id_field: next((j.job_id for j in jobs if j.kind is kind), None) for kind in JobKind}

    async def _start_in_order(self, jobs: list[Job]) -> None:
        for job in jobs:
            await job.start()

    async def status(self) -> dict:
        return {
            "device": self.device,
            "jobs": [job.status() for job in self.jobs.values()],
            "served": dict(self.served),
        }

    async def job_status(self, job_id: int) -> dict:
        return self._job(job_id).status()

    async def destroy_job(self, job_id: int) -> dict:
        job = self._job(job_id)
        async with self._locks[job_id]:
            await job.destroy()
        return job.status()

    async def stop_server(self) -> dict:
        await self.destroy_all()
        if self._on_stop is not None:
            self._on_stop()
        return {"status": "stopping"}

    async def echo(self, payload: Any) -> Any:
        return payload

    async def destroy_all(self) -> None:
        # Training first: it may hold the NCCL group the others joined.
        order = {JobKind.TRAINING: 0, JobKind.LOG_PROB: 1, JobKind.SAMPLING: 2}
        for job in sorted(self.jobs.values(), key=lambda j: order[j.kind]):
            await job.destroy()

    # ------------------------------------------------------------ job ops

    async def dispatch(self, op: Op, request) -> Any:
        self.served[op.name] = self.served.get(op.name, 0) + 1
        payload = {name: getattr(request, name) for name in op.payload_fields}
        if op.server:
            return await getattr(self, op.name)(**payload)
        kind = op.job_kind(request)
        job_id = getattr(request, kind.id_field)
        if job_id is None:
            if op.absent_result is not None:
                return dict(op.absent_result)
            raise BadRequest(f"{op.name} needs a {kind.value} job; this deployment has none ({kind.value}_gpus=0)")
        job = self._job(job_id, kind)
        method = getattr(job, op.name)
        accepted = inspect.signature(method).parameters
        related = {}
        for field in op.routing_fields:
            other_kind = JobKind(field.removesuffix("_job_id"))
            other_id = getattr(request, field)
            if other_kind is not kind and other_id is not None and other_kind.value in accepted:
                related[other_kind.value] = self._job(other_id, other_kind)
        involved = sorted({job.job_id, *(j.job_id for j in related.values())})
        async with contextlib.AsyncExitStack() as stack:
            for jid in involved:
                if isinstance(self.jobs[jid], DeepSpeedJob):
                    await stack.enter_async_context(self._locks[jid])
            for j in (job, *related.values()):
                j.ensure_running()
            return await method(**related, **{k: v for k, v in payload.items() if k in accepted})

    def _job(self, job_id: int, kind: JobKind | None = None) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no job with id {job_id}; known: {sorted(self.jobs)}")
        if kind is not None and job.kind is not kind:
            raise BadRequest(f"job {job_id} is a {job.kind.value} job, not a {kind.value} job")
        return job

    # ------------------------------------------------------------ building jobs

    def _device(self, requested: str) -> str:
        if requested == "auto":
            return self.device
        if requested == "cuda" and self.device != "cuda":
            raise BadRequest('device="cuda" but this server has no CUDA devices; use "cpu" or "auto"')
        return requested

    async def _place(self, wanted: dict[JobKind, int], colocate: bool, timeout: float) -> dict:
        slots: dict = {"release": {}}
        if colocate:
            group = await placement.reserve(max(wanted.values()), timeout)
            shared = placement.SharedGroup(group, holders=len(wanted))
            for kind, count in wanted.items():
                slots[kind] = placement.colocated_slots(group, count, sharers=len(wanted))
                slots["release"][kind] = shared.release
        else:
            reserved = []
            try:
                for kind, count in wanted.items():
                    group = await placement.reserve(count, timeout)
                    reserved.append(group)
                    slots[kind] = placement.split_slots(group, count)
                    slots["release"][kind] = lambda g=group: placement.remove_placement_group(g)
            except BaseException:
                for group in reserved:  # no job holds them yet
                    placement.remove_placement_group(group)
                raise
        return slots

    def _builder(self, kind: JobKind, config: ArcticRLClientConfig, device: str) -> Callable[..., Job]:
        """``(job_id, slots, threads) -> Job`` for ``kind``, with the job's settings validated now."""
        if kind is JobKind.SAMPLING:
            options = sampling_options(config, device)
            return lambda job_id, slots, threads: SamplingJob(
                job_id, slots, threads, config.model_name, config.sampling_engine, options
            )
        if kind is JobKind.TRAINING:
            training = _training_config(
                {**(config.ds_worker_config or {}), **(config.training_config or {})}, "training_config", device
            )
            weight_sync = _weight_sync(config)
            spec = WorkerSpec(
                model_name=config.model_name,
                device=device,
                trainable=True,
                training=training,
                ds_config=config.ds_config,
                checkpoint_path=config.checkpoint_path,
                seed=config.seed,
                full_determinism=config.full_determinism,
                allowed_loss_prefixes=self.allowed_loss_prefixes,
                weight_sync_bucket_size=weight_sync.bucket_size,
                split_weight_sync=None if config.colocate else weight_sync.model_dump(exclude_unset=True),
            )
            default = Processing(loss_fn=training.default_loss, config=training.default_loss_config)
            return lambda job_id, slots, threads: TrainingJob(job_id, slots, threads, spec, default_processing=default)
        return self._log_prob_builder(config, device)

    def _log_prob_builder(self, config: ArcticRLClientConfig, device: str) -> Callable[..., Job]:
        if config.log_prob_engine == "vllm":
            from arctic_rl_core.server.vllm_log_prob_job import VLLMLogProbJob

            options = sampling_options(config, device)
            return lambda job_id, slots, threads: VLLMLogProbJob(job_id, slots, threads, config.model_name, options)
        settings = dict(config.log_prob_ds_config or {})
        ds_config = settings.pop("ds_config", {})
        training_dtype = (config.training_config or {}).get("dtype")
        if training_dtype and "dtype" not in settings:
            settings["dtype"] = training_dtype
        spec = WorkerSpec(
            model_name=config.model_name,
            device=device,
            trainable=False,
            training=_training_config(settings, "log_prob_ds_config", device),
            ds_config=ds_config,
            seed=config.seed,
            full_determinism=config.full_determinism,
        )
        return lambda job_id, slots, threads: LogProbJob(job_id, slots, threads, spec)


def _training_config(settings: dict, field: str, device: str) -> TrainingConfig:
    try:
        training = TrainingConfig.model_validate(settings)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc, field)) from None
    if training.dtype == "float16" and device == "cpu":
        # DeepSpeed would fail in every worker's setup ("fp16 is not supported on your device").
        raise BadRequest(f"{field}.dtype: 'float16' needs CUDA; on CPU use 'bfloat16' or 'float32'")
    return training


def _weight_sync(config: ArcticRLClientConfig) -> WeightSyncConfig:
    try:
        return WeightSyncConfig.model_validate(config.weight_sync_config or {})
    except ValueError as exc:
        raise BadRequest(f"weight_sync_config: {exc}") from None


def sampling_options(config: ArcticRLClientConfig, device: str) -> SamplingEngineOptions:
    """SamplingEngineOptions from vllm_config and arctic_inference_config; unknown keys go to ``extra``."""
    vllm = dict(config.vllm_config or {})
    known = {_SAMPLING_KEYS[k]: vllm.pop(k) for k in list(vllm) if k in _SAMPLING_KEYS}
    inference = dict(config.arctic_inference_config or {})
    zorro = inference.pop("zorro_inference", None) or {}
    use_fca = inference.pop("use_fca", zorro.get("enable", True))
    # Other ArcticInference settings (spec_model, ...) go to the backend, which accepts or names them.
    vllm.update(inference)
    if "dtype" not in known:
        training_dtype = (config.training_config or {}).get("dtype", "bfloat16")
        known["dtype"] = training_dtype if device == "cuda" else "float32"
    try:
        return SamplingEngineOptions(device=device, seed=config.seed, use_fca=bool(use_fca), extra=vllm, **known)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc, "vllm_config")) from None
