"""The sampling job: replicas of ``SamplingWorker``, load-balanced.

Generate calls run concurrently (each replica serializes its own engine);
weight loads, sleep and wake take the job exclusively, so no generate ever
samples from half-loaded weights.
"""

from __future__ import annotations

import asyncio
import contextlib

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.engines.sampling.worker import SamplingWorker
from arctic_rl_core.errors import BadRequest
from arctic_rl_core.ops import JobKind
from arctic_rl_core.server.jobs import Job, remote_worker

# Many callers wait on one replica at once (frameworks send one request per prompt): threads are cheap,
# and the device work runs on the engine's own loop thread.
RemoteSamplingWorker = remote_worker(SamplingWorker, max_concurrency=256)

# What sleep_inference frees (any level, on some backend) and wake_inference(tags) restores.
SLEEP_TAGS = ("weights", "kv_cache")


class SharedExclusiveLock:
    """Many shared holders (generate) or one exclusive holder (weight load, sleep, wake).

    A waiting exclusive caller goes first: shared callers that arrive after it
    queue behind it. Otherwise rollouts that never pause (async RL keeps some
    generate call in flight at every instant) would starve a weight sync forever.
    """

    def __init__(self):
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._changed:
                self._shared -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        async with self._changed:
            self._exclusive_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._exclusive and self._shared == 0)
            except BaseException:
                self._changed.notify_all()  # a cancelled waiter lets the shared callers it held back go
                raise
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._changed:
                self._exclusive = False
                self._changed.notify_all()


class SamplingJob(Job):
    kind = JobKind.SAMPLING

    def __init__(self, job_id, slots, threads, model_name: str, engine: str, options: SamplingEngineOptions):
        super().__init__(job_id, slots, threads)
        self.model_name, self.engine, self.options = model_name, engine, options
        self.lock = SharedExclusiveLock()
        self._in_flight: list[int] = []
        self.max_model_len: int | None = None  # set at start: options.max_model_len or the model's positions
        self._freed: set[str] = set()  # what sleep_inference freed and wake_inference has not restored yet

    async def _create_workers(self) -> None:
        self.workers = [
            RemoteSamplingWorker.options(**slot.actor_options()).remote(
                replica, self.model_name, self.engine, self.options, self.threads
            )
            for replica, slot in enumerate(self.slots)
        ]
        self._in_flight = [0] * len(self.workers)
        self.max_model_len = self.options.max_model_len or await asyncio.to_thread(_max_positions, self.model_name)

    def check_generate(self, sampling_params: SamplingParams) -> None:
        """Refuse what the engines would refuse (or run for minutes) before any replica sees it."""
        if self._freed:
            raise BadRequest(
                f"{self.name} is asleep ({', '.join(sorted(self._freed))} freed by sleep_inference); "
                "call wake_inference() before generate"
            )
        if self.max_model_len is not None and sampling_params.max_tokens >= self.max_model_len:
            raise BadRequest(
                f"sampling_params.max_tokens={sampling_params.max_tokens}: expected < max_model_len="
                f"{self.max_model_len} (prompt and completion share it)"
            )

    def _assign(self, count: int) -> list[tuple[int, int, int]]:
        """(replica, start, stop) chunks: an even split, least-loaded replicas first."""
        replicas = sorted(range(len(self.workers)), key=lambda r: self._in_flight[r])[
            : max(1, min(count, len(self.workers)))
        ]
        size, extra = divmod(count, len(replicas))
        chunks, start = [], 0
        for i, replica in enumerate(replicas):
            stop = start + size + (1 if i < extra else 0)
            chunks.append((replica, start, stop))
            start = stop
        return chunks

    async def generate(
        self, prompts: list[str] | None, sampling_params: SamplingParams, prompt_token_ids: list[list[int]] | None
    ) -> list[dict]:
        items = prompts if prompts is not None else prompt_token_ids
        async with self.lock.shared():
            self.check_generate(sampling_params)
            chunks = self._assign(len(items))
            refs = []
            for replica, start, stop in chunks:
                self._in_flight[replica] += stop - start
                refs.append(
                    self.workers[replica].generate.remote(
                        prompts[start:stop] if prompts is not None else None,
                        prompt_token_ids[start:stop] if prompt_token_ids is not None else None,
                        sampling_params,
                    )
                )
            try:
                parts = await self.gather(refs)
            finally:
                for replica, start, stop in chunks:
                    self._in_flight[replica] -= stop - start
        return [result for part in parts for result in part]

    async def load_weights_from_file(self, directory: str) -> list[dict]:
        async with self.lock.exclusive():
            return await self.call_all("load_weights_from_file", directory)

    async def load_coordinated(self, group: tuple[dict, str] | None) -> list[dict]:
        """Every replica receives one sync through its coordinator while the training ranks send.

        ``group`` (config, rendezvous address) first forms a new weight-sync group.
        """
        async with self.lock.exclusive():
            return await self.call_all("load_coordinated", group)

    async def load_ipc(self, handles_by_rank: list[list]) -> list[dict]:
        """Replica r maps the buckets of training rank r (mod ranks): colocated, they share a GPU."""
        async with self.lock.exclusive():
            refs = [w.load_ipc.remote(handles_by_rank[r % len(handles_by_rank)]) for r, w in enumerate(self.workers)]
            return await self.gather(refs)

    async def forget_ipc(self) -> list[dict]:
        """Every replica unmaps the buffers of the training engine's IPC session (before training frees them)."""
        async with self.lock.exclusive():
            return await self.call_all("forget_ipc")

    async def weight_norms(self) -> list[float]:
        async with self.lock.exclusive():
            return await self.call_all("weight_norm")

    async def sleep_inference(self, level: int) -> dict:
        async with self.lock.exclusive():
            self._freed = set(SLEEP_TAGS)
            return {"replicas": await self.call_all("sleep", level)}

    async def wake_inference(self, tags: list[str] | None) -> dict:
        async with self.lock.exclusive():
            result = {"replicas": await self.call_all("wake", tags)}
            self._freed -= set(tags or SLEEP_TAGS)
            return result

    async def reset_prefix_cache(self) -> dict:
        async with self.lock.exclusive():
            return {"replicas": await self.call_all("reset_prefix_cache")}


def _max_positions(model_name: str) -> int | None:
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_name), "max_position_embeddings", None)
