"""The training job and the DeepSpeed log-prob job: ranks of ``DeepSpeedWorker``.

The job validates a batch once, computes the call's global denominators,
shards rows across ranks, and reduces what the ranks return. Workers trust
what they get.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from arctic_rl_core.engines.batching import RowBatch, contiguous_split
from arctic_rl_core.engines.training.worker import DeepSpeedWorker, LossCall, WorkerSpec
from arctic_rl_core.errors import BadRequest
from arctic_rl_core.ops import Batch, JobKind, Processing
from arctic_rl_core.server.jobs import Job, JobState, remote_worker

logger = logging.getLogger(__name__)

RemoteDeepSpeedWorker = remote_worker(DeepSpeedWorker)


def sync_root() -> Path:
    """Where file-path weight syncs are staged; must be visible to training rank 0 and every replica."""
    return Path(os.environ.get("ARCTIC_RL_SYNC_DIR") or Path(tempfile.gettempdir()) / "arctic-rl-sync")


class DeepSpeedJob(Job):
    """Ranks of one DeepSpeed engine: data-parallel batch sharding and forward passes."""

    def __init__(self, job_id, slots, threads, spec: WorkerSpec, default_processing: Processing | None = None):
        super().__init__(job_id, slots, threads)
        self.spec = spec
        self.default_processing = default_processing
        self._tokenizer = None
        self.vocab_size: int | None = None  # from rank 0 at start
        self.max_positions: int | None = None
        self.zero_stage = 0

    async def _create_workers(self) -> None:
        world = len(self.slots)
        spec = self.spec
        spec.threads = self.threads
        self.workers = [
            RemoteDeepSpeedWorker.options(**slot.actor_options(), name=None).remote(rank, world, spec)
            for rank, slot in enumerate(self.slots)
        ]
        address = await self.workers[0].rendezvous_address.remote()
        infos = await asyncio.gather(*[w.setup.remote(*address) for w in self.workers])
        self.vocab_size, self.max_positions = infos[0]["vocab_size"], infos[0]["max_positions"]
        self.zero_stage = infos[0]["zero_stage"]

    # ------------------------------------------------------------ batches

    def check_batch(self, batch: Batch) -> None:
        """What only the model can settle: ids in its vocabulary, T within its positions, 0/1 masks, finite context.

        Checked before any rank sees the batch: an id outside the embedding table would raise inside a rank, and a
        NaN advantage would quietly poison the weights.
        """
        ids = batch.input_ids
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise BadRequest(
                f"batch.args[0] (input_ids): token ids must lie in [0, {self.vocab_size}) (the model's vocabulary), "
                f"got values from {low} to {high}"
            )
        if self.max_positions is not None and ids.shape[1] > self.max_positions:
            raise BadRequest(
                f"batch.args[0] (input_ids): T={ids.shape[1]} exceeds the model's max_position_embeddings="
                f"{self.max_positions}"
            )
        mask = batch.kwargs.get("attention_mask")
        if mask is not None and not ((mask == 0) | (mask == 1)).all():
            values = mask.unique()[:8].tolist()
            raise BadRequest(f"batch.kwargs.attention_mask: expected only 0 and 1, got values {values}")
        for name, tensor in batch.context.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise BadRequest(f"batch.context.{name}: holds NaN or infinite values; expected finite numbers")

    @staticmethod
    def rows(batch: Batch, loss_mask: torch.Tensor | None = None) -> RowBatch:
        return RowBatch(batch.input_ids.long(), batch.attention_mask, loss_mask, dict(batch.context))

    def shards(self, rows: RowBatch) -> list[RowBatch]:
        lengths = rows.attention_mask.sum(-1).tolist()
        return [rows.select(a, b) for a, b in contiguous_split(lengths, len(self.workers))]

    async def fwd_no_grad(self, batch: Batch, processing: Processing | None, return_entropy: bool, **_) -> dict:
        post = processing.post if processing is not None else []
        _validate_post(post)
        self.check_batch(batch)
        parts = await self.call_each(
            "fwd_no_grad", [(shard, post, return_entropy) for shard in self.shards(self.rows(batch))]
        )
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    async def weight_norm(self) -> float:
        return (await self.call_all("weight_norm"))[0]

    async def sleep(self, mode: str) -> dict:
        return {"workers": await self.call_all("sleep", mode)}

    async def wake(self) -> dict:
        return {"workers": await self.call_all("wake")}

    # ------------------------------------------------------------ text log-probs

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.spec.model_name)
        return self._tokenizer

    async def log_probs(self, prompts: list[str], completions: list[str] | None, top_k: int) -> list[dict]:
        """Log-probs of each completion's tokens given its prompt (or of the prompt's own tokens)."""
        tok = self.tokenizer()
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids = (
            [tok(c, add_special_tokens=False)["input_ids"] for c in completions] if completions is not None else None
        )
        sequences = [p + (completion_ids[i] if completion_ids else []) for i, p in enumerate(prompt_ids)]
        if any(len(s) < 2 for s in sequences):
            raise BadRequest("log_probs: every prompt (+ completion) must tokenize to at least 2 tokens")
        width = max(len(s) for s in sequences)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        shards = self.shards(RowBatch(ids, mask))
        parts = await self.call_each("token_log_probs", [(shard, top_k) for shard in shards])
        log_probs = torch.cat([p["log_probs_shifted"] for p in parts])
        top_ids = torch.cat([p["top_ids"] for p in parts]) if top_k else None
        top_lps = torch.cat([p["top_log_probs"] for p in parts]) if top_k else None
        results = []
        for i, seq in enumerate(sequences):
            first = len(prompt_ids[i]) if completion_ids else 1
            # Position t of the shifted layout scores token t+1.
            scored = range(first - 1, len(seq) - 1)
            entry = {
                "prompt": prompts[i],
                "completion": completions[i] if completions is not None else None,
                "prompt_token_ids": prompt_ids[i],
                "completion_token_ids": completion_ids[i] if completion_ids else [],
                "token_ids": [seq[t + 1] for t in scored],
                "token_log_probs": [float(log_probs[i, t]) for t in scored],
            }
            if top_k:
                entry["top_log_probs"] = [
                    [[int(a), float(b)] for a, b in zip(top_ids[i, t].tolist(), top_lps[i, t].tolist())] for t in scored
                ]
            results.append(entry)
        return results


class LogProbJob(DeepSpeedJob):
    kind = JobKind.LOG_PROB

    async def sleep_log_prob(self) -> dict:
        return await self.sleep("all")

    async def wake_log_prob(self) -> dict:
        return await self.wake()


class TrainingJob(DeepSpeedJob):
    kind = JobKind.TRAINING

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sync_version = 0
        # (sampling job, low_memory) of the open CUDA-IPC session, whose buffers the sampler keeps mapped.
        self._ipc_peer: tuple | None = None
        # The sampling job whose replicas share a weight-sync group with our ranks (split placement).
        self._coordinated_peer = None
        self._coordinated_lock = asyncio.Lock()

    async def fwd_bwd(self, batch: Batch, processing: Processing | None) -> dict:
        from arctic_rl_core.processors import loss_mask_from_context, resolve_loss, validate_batch_context

        processing = processing or self.default_processing
        try:
            spec = resolve_loss(processing.loss_fn, self.spec.allowed_loss_prefixes)
            config = spec.parse_config(processing.config)
        except ValueError as exc:
            raise BadRequest(f"processing: {exc}") from None
        _validate_post(processing.post)
        self.check_batch(batch)
        context = dict(batch.context)
        if "response_mask" not in context and "loss_mask_shifted" not in context:
            # No mask given: every next token that is not padding counts, as in plain LM training.
            attention = batch.attention_mask
            shifted = torch.zeros_like(attention, dtype=torch.float32)
            shifted[:, :-1] = (attention[:, :-1] * attention[:, 1:]).float()
            context["loss_mask_shifted"] = shifted
        loss_mask = loss_mask_from_context(context, batch.attention_mask)
        validate_batch_context(spec, config, context, tuple(batch.input_ids.shape))
        used = spec.required_context(config) | spec.optional_context(config)
        rl_context = {k: v.float() for k, v in context.items() if k in used}
        rows = RowBatch(batch.input_ids.long(), batch.attention_mask, loss_mask, rl_context)
        call = LossCall(
            loss_fn=processing.loss_fn,
            config=processing.config,
            post=processing.post,
            global_tokens=float(loss_mask.sum()),
            global_seqs=float((loss_mask.sum(-1) > 0).sum()),
            horizon=int(batch.input_ids.shape[1]),
        )
        # A call whose loss mask selects nothing (every response filtered out) still runs: its loss and
        # gradients are 0 and step() may follow, as in verl and SkyRL.
        results = await self.call_each("fwd_bwd", [(shard, call) for shard in self.shards(rows)])
        return reduce_metrics(results)

    async def step(self) -> dict:
        ranks = await self.call_all("step")
        return {**ranks[0], "micro_batches": sum(rank["micro_batches"] for rank in ranks)}

    async def save_checkpoint(self, path: str | None) -> dict:
        directory = path or self.spec.checkpoint_path or str(Path.cwd() / "checkpoints")
        return (await self.call_all("save_checkpoint", directory))[0]

    async def sleep_training(self, mode: str) -> dict:
        await self._end_ipc_session()  # the workers free it as they sleep; the sampler must let go first
        return await self.sleep(mode)

    async def wake_training(self) -> dict:
        return await self.wake()

    async def empty_training_cache(self) -> dict:
        return {"workers": await self.call_all("empty_cache")}

    async def sync_weights(self, sampling, cuda_ipc: bool, low_memory: bool) -> dict:
        """Training weights into every sampling replica; the replicas reset their prefix caches."""
        import time

        started = time.perf_counter()
        if cuda_ipc:
            if self.spec.device != "cuda":
                raise BadRequest("sync_weights(cuda_ipc=True) needs CUDA; on CPU use cuda_ipc=False (file path)")
            loaded, buckets = await self._sync_ipc(sampling, low_memory)
            return {"status": "ok", "method": "cuda_ipc_low_memory" if low_memory else "cuda_ipc",
                    "buckets": buckets, "replicas": loaded, "seconds": time.perf_counter() - started}  # fmt: skip
        if self.spec.split_weight_sync is not None:
            loaded = await self._sync_coordinated(sampling)
            return {"status": "ok", "method": "coordinator", "backend": "nccl" if self.spec.device == "cuda" else "gloo",
                    "replicas": loaded, "seconds": time.perf_counter() - started}  # fmt: skip
        self._sync_version += 1
        directory = sync_root() / f"job{self.job_id}-{uuid.uuid4().hex[:8]}-v{self._sync_version}"
        try:
            written = (await self.call_all("export_weights", str(directory)))[0]
            loaded = await sampling.load_weights_from_file(str(directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return {
            "status": "ok",
            "method": "file",
            "bytes": written.get("bytes", 0),
            "tensors": written.get("tensors", 0),
            "replicas": loaded,
            "seconds": time.perf_counter() - started,
        }

    async def _sync_ipc(self, sampling, low_memory: bool) -> tuple[list, int]:
        """Flattened buckets over CUDA IPC; low_memory shares and loads one bucket at a time.

        The workers keep an IPC session (plan, buffers, handles) and the sampler its
        mappings until training sleeps: a later sync while awake maps nothing anew.
        """
        if self._ipc_peer not in (None, (sampling, low_memory)):
            await self._end_ipc_session()
        self._ipc_peer = (sampling, low_memory)
        counts = await self.call_all("ipc_open", self.spec.weight_sync_bucket_size, low_memory)
        try:
            if not low_memory:
                return await sampling.load_ipc(await self.call_all("ipc_share", None)), counts[0]
            loaded = []
            for index in range(counts[0]):
                loaded = await sampling.load_ipc(await self.call_all("ipc_share", index))
                await self.call_all("ipc_release", index)
            return loaded, counts[0]
        finally:
            await self.call_all("ipc_release", None)

    async def _sync_coordinated(self, sampling) -> list:
        """Split placement: every rank sends through the WeightSyncCoordinator while every replica receives.

        The group (ranks + replicas) is formed in the first sync with a sampling
        job (a new one forms a new group) and kept; under ZeRO-3 each rank sends
        its flat partitions and the group gathers them bucket by bucket. Syncs
        run one at a time: two in one group would interleave their buckets.
        """
        async with self._coordinated_lock:
            group = None if self._coordinated_peer is sampling else await self._group_for(sampling)
            self._coordinated_peer = None  # until this sync has formed the group and gone through
            _, loaded = await asyncio.gather(self.call_all("coordinator_send", group), sampling.load_coordinated(group))
            self._coordinated_peer = sampling
            return loaded

    async def _group_for(self, sampling) -> tuple[dict, str]:
        """The WeightSyncConfig and rendezvous address of a group of our ranks and ``sampling``'s replicas."""
        from arctic_rl_core.config import WeightSyncConfig

        master_addr, port = await self.workers[0].rendezvous_address.remote()
        # The user's bucket size, timeout and port (a free one unless named); the topology is the deployment's,
        # whatever weight_sync_config says of it.
        config = WeightSyncConfig(
            **{
                "base_port": port,
                **self.spec.split_weight_sync,
                "training_sharding": "fsdp" if self.zero_stage == 3 else "dp",
                "training_gpus": len(self.workers),
                "inference_replicas": len(sampling.workers),
                "inference_tp": 1,  # one receiving worker per replica: its engine shards for its own TP
            }
        )
        return config.model_dump(), master_addr

    async def _end_ipc_session(self) -> None:
        if self._ipc_peer is None:
            return
        sampling, _ = self._ipc_peer
        self._ipc_peer = None
        if sampling.state is JobState.RUNNING:
            await sampling.forget_ipc()
        await self.call_all("ipc_close")

    async def destroy(self) -> None:
        if self._ipc_peer is not None and self.state is JobState.RUNNING:
            try:
                await self._end_ipc_session()
            except Exception:  # noqa: BLE001 - destroying anyway; the sampler's mapping dies with our memory
                logger.warning("%s: could not end the CUDA-IPC session before shutdown", self.name, exc_info=True)
        await super().destroy()

    async def weight_norm(self, sampling=None, log_prob=None) -> dict:
        result = {"training_norm": (await self.call_all("weight_norm"))[0]}
        if sampling is not None:
            norms = await sampling.weight_norms()
            result["sampling_norm"], result["sampling_norms"] = norms[0], norms
        if log_prob is not None:
            result["log_prob_norm"] = await log_prob.weight_norm()
        return result


def _validate_post(post: list) -> None:
    from arctic_rl_core.processors import resolve_post

    try:
        resolve_post(post)
    except ValueError as exc:
        raise BadRequest(f"processing.post: {exc}") from None


def reduce_metrics(results: list[dict]) -> dict:
    """Token-weighted means across ranks and micro-batches; maxima by max; the loss summed."""
    sums: dict[str, list[float]] = {}
    maxima: dict[str, float] = {}
    for result in results:
        for name, (total, weight) in result["sums"].items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += total
            acc[1] += weight
        for name, value in result["maxima"].items():
            maxima[name] = max(maxima.get(name, float("-inf")), value)
    metrics = {name: total / weight if weight else 0.0 for name, (total, weight) in sums.items()}
    metrics.update(maxima)
    return {
        "loss": sum(r["loss"] for r in results),
        "metrics": metrics,
        "micro_batches": sum(r["micro_batches"] for r in results),
    }
