"""A job: a set of Ray worker actors with one state, PENDING -> RUNNING -> (FAILED | DESTROYED).

A job notices a dead worker at once: it keeps a ``watch`` call open on every
worker, and when one returns with an error the job turns FAILED with the
cause, its other workers are killed (they would hang in collectives), and every
pending and later call raises ``JobFailedError`` naming the job and the cause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum
from typing import Any, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from arctic_rl_core.errors import JobFailedError, JobNotReady
from arctic_rl_core.ops import JobKind
from arctic_rl_core.server.placement import Slot

logger = logging.getLogger(__name__)

# Liveness calls (``watch`` blocks for the worker's life, ``info``) run in their own concurrency group,
# so they never wait behind engine work and never take an engine thread.
CONTROL = "control"
# How long a call that failed on one rank waits to learn whether a peer died (see ``Job._peer_died``).
PEER_DEATH_GRACE_S = 5.0


def remote_worker(cls, max_concurrency: int = 1):
    """``cls`` as a Ray actor class whose engine calls run on ``max_concurrency`` threads (one by default).

    One thread is what a GPU engine wants: CUDA libraries keep state per calling thread (cuBLAS a
    handle and a 32 MiB workspace for each thread that runs a matmul), so calls spread over a pool
    leave one copy per thread on the device, and a sleeping engine cannot give them back.
    """
    return ray.remote(max_concurrency=max_concurrency, concurrency_groups={CONTROL: 2})(cls)


class JobState(str, Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    FAILED = "FAILED"
    DESTROYED = "DESTROYED"


class Job:
    """Base of the three job kinds: worker lifecycle, failure detection, and calls to ranks."""

    kind: JobKind

    def __init__(self, job_id: int, slots: list[Slot], threads: int | None):
        self.job_id = job_id
        self.slots = slots
        self.threads = threads
        self.state = JobState.PENDING
        self.error: str | None = None
        self.workers: list[ray.actor.ActorHandle] = []
        self.created_at = time.time()
        self.calls = 0
        self.pids: list[int] = []
        self._watchers: list[asyncio.Task] = []
        self._failed = asyncio.Event()
        self.on_release = None  # set by the manager: gives back the placement group

    @property
    def name(self) -> str:
        return f"{self.kind.value} job {self.job_id}"

    def status(self) -> dict:
        return {
            "job_id": self.job_id,
            "kind": self.kind.value,
            "state": self.state.value,
            "error": self.error,
            "workers": len(self.slots),
            "pids": list(self.pids),
            "calls": self.calls,
        }

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create and set up the workers; RUNNING on success, FAILED (with the cause) otherwise."""
        if self.state is not JobState.PENDING:
            return  # destroyed before its turn came: its placement group is gone, and no one would kill its workers
        try:
            await self._create_workers()
            self.pids = [info["pid"] for info in await self.worker_infos()]
            self._watchers = [asyncio.ensure_future(self._watch(rank, w)) for rank, w in enumerate(self.workers)]
            if self.state is JobState.PENDING:
                self.state = JobState.RUNNING
                logger.info("%s RUNNING (%d workers)", self.name, len(self.workers))
        except Exception as exc:  # noqa: BLE001 - any start failure is the job's failure
            self.fail(f"start failed: {_describe(exc)}")

    async def _create_workers(self) -> None:
        raise NotImplementedError

    async def worker_infos(self) -> list[dict]:
        """Each worker's ``info()``; answered even while an engine call runs (the workers are up once it returns)."""
        return await asyncio.gather(*[w.info.options(concurrency_group=CONTROL).remote() for w in self.workers])

    async def _watch(self, rank: int, worker) -> None:
        try:
            await worker.watch.options(concurrency_group=CONTROL).remote()
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001
            if self.state is not JobState.DESTROYED:
                self.fail(f"worker {rank} died: {_describe(exc)}")

    def fail(self, reason: str) -> None:
        if self.state in (JobState.FAILED, JobState.DESTROYED):
            return
        self.state, self.error = JobState.FAILED, reason
        self._failed.set()
        logger.error("%s FAILED: %s", self.name, reason)
        self._kill_workers()

    async def destroy(self) -> None:
        if self.state is JobState.DESTROYED:
            return
        self.state = JobState.DESTROYED
        self._failed.set()
        for task in self._watchers:
            task.cancel()
        await self._graceful_shutdown()
        self._kill_workers()

    async def _graceful_shutdown(self) -> None:
        refs = [w.shutdown.remote() for w in self.workers]
        if refs:
            await asyncio.wait([asyncio.ensure_future(_await(r)) for r in refs], timeout=10)

    def _kill_workers(self) -> None:
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.on_release is not None:
            self.on_release()
            self.on_release = None

    # ------------------------------------------------------------ calls

    def ensure_running(self) -> None:
        if self.state is JobState.FAILED:
            raise JobFailedError(f"{self.name} is FAILED: {self.error}")
        if self.state is not JobState.RUNNING:
            raise JobNotReady(f"{self.name} is {self.state.value}")

    async def gather(self, refs: Sequence[ray.ObjectRef]) -> list[Any]:
        """Await worker calls; a dead worker fails the job and raises at once, even mid-call."""
        self.ensure_running()
        self.calls += 1
        calls = [asyncio.ensure_future(_await(r)) for r in refs]
        for call in calls:
            # gather raises the first rank's error; the others' are expected (they died too), not "never retrieved"
            call.add_done_callback(_retrieve)
        results = asyncio.ensure_future(asyncio.gather(*calls))
        failed = asyncio.ensure_future(self._failed.wait())
        done, _ = await asyncio.wait({results, failed}, return_when=asyncio.FIRST_COMPLETED)
        if results in done:
            failed.cancel()
            try:
                return results.result()
            except RayActorError as exc:
                self._died_during_call(exc)
                raise JobFailedError(f"{self.name} is FAILED: {self.error}") from None
            except RayTaskError as exc:
                error = _unwrap(exc)
                # A rank's collective fails as soon as a peer dies, often before that death is reported: the
                # death, not the collective's error, is the cause. (The caller's own mistakes answer at once.)
                if not isinstance(error, ValueError) and await self._peer_died(calls):
                    raise JobFailedError(f"{self.name} is FAILED: {self.error}") from None
                raise error from None
        results.cancel()
        raise JobFailedError(f"{self.name} is {self.state.value}: {self.error or 'destroyed during the call'}")

    async def _peer_died(self, calls: list[asyncio.Future]) -> bool:
        """Whether a worker died around a failed call: the job's watch or a rank's own call reports it (the
        wait ends when every rank has answered, the job fails, or after ``PEER_DEATH_GRACE_S``)."""
        failed = asyncio.ensure_future(self._failed.wait())
        answered = asyncio.ensure_future(asyncio.wait(calls))
        await asyncio.wait({failed, answered}, timeout=PEER_DEATH_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
        answered.cancel()
        for call in calls:
            if call.done() and not call.cancelled() and isinstance(call.exception(), RayActorError):
                self._died_during_call(call.exception())
        return self.state is JobState.FAILED

    def _died_during_call(self, exc: RayActorError) -> None:
        self.fail(f"a worker died during the call: {_describe(exc)}")

    async def call_all(self, method: str, *args, **kwargs) -> list[Any]:
        return await self.gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    async def call_each(self, method: str, per_rank: Sequence[tuple]) -> list[Any]:
        return await self.gather([getattr(w, method).remote(*args) for w, args in zip(self.workers, per_rank)])


async def _await(ref):
    return await ref


def _retrieve(call: asyncio.Future) -> None:
    if not call.cancelled():
        call.exception()


def _unwrap(exc: RayTaskError) -> BaseException:
    """The worker's own exception (a ValueError stays a ValueError, so it becomes a 4xx)."""
    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    if isinstance(cause, RayTaskError):
        return _unwrap(cause)
    return cause


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:2000]
