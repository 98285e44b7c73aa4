"""A job call that fails on one rank: a peer's death is reported as the job's failure, whichever answers first.

Real Ray actors stand in for a job's ranks. When a rank dies mid-call, a surviving rank's collective fails at once
(gloo: "Read error"), usually before Ray reports the death: the call must still raise ``JobFailedError``.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

from arctic_rl_core.errors import JobFailedError
from arctic_rl_core.ops import JobKind
from arctic_rl_core.server.jobs import PEER_DEATH_GRACE_S, Job, JobState
from arctic_rl_core.server.ray_cluster import connect

pytestmark = pytest.mark.slow


@ray.remote
class Rank:
    def fail_at_once(self, kind: str):
        raise {"runtime": RuntimeError, "value": ValueError}[kind](f"{kind} error on this rank")

    def die_after(self, seconds: float):
        time.sleep(seconds)
        os._exit(1)

    def hang(self, seconds: float):
        time.sleep(seconds)

    def ok(self):
        return "ok"


class TwoRanks(Job):
    kind = JobKind.TRAINING

    def __init__(self):
        super().__init__(job_id=7, slots=[None, None], threads=None)
        self.workers = [Rank.remote(), Rank.remote()]
        ray.get([w.ok.remote() for w in self.workers])
        self.state = JobState.RUNNING


@pytest.fixture(scope="module")
def device():
    started = not ray.is_initialized()
    yield connect(False, "arctic-rl-job-calls", cpu_gpus=2, log_to_driver=False)
    if started:
        ray.shutdown()


@pytest.fixture
def job(device):
    """Two fresh ranks; killed afterwards (one may still be sleeping), so none outlives its test in a shared Ray."""
    job = TwoRanks()
    yield job
    job._kill_workers()


async def call(job: TwoRanks, first: tuple, second: tuple) -> tuple[BaseException | None, float]:
    """``first`` on rank 0 and ``second`` on rank 1 as one job call: (what it raised, seconds it took)."""
    refs = [getattr(job.workers[rank], name).remote(*args) for rank, (name, *args) in enumerate((first, second))]
    start = time.monotonic()
    try:
        await job.gather(refs)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def test_a_rank_that_fails_before_its_peer_is_reported_dead_fails_the_job(job):
    error, _ = asyncio.run(call(job, ("fail_at_once", "runtime"), ("die_after", 0.5)))
    assert isinstance(error, JobFailedError), error
    assert "training job 7 is FAILED: a worker died during the call" in str(error)
    assert job.state is JobState.FAILED


def test_an_error_on_every_rank_with_no_death_is_the_ranks_own_and_the_job_keeps_running(job):

    async def twice():
        return await call(job, ("fail_at_once", "runtime"), ("fail_at_once", "runtime")), await call(
            job, ("ok",), ("ok",)
        )

    (error, _), (after, _) = asyncio.run(twice())
    assert type(error) is RuntimeError and "runtime error on this rank" in str(error)
    assert job.state is JobState.RUNNING and after is None


def test_a_callers_mistake_answers_at_once_even_while_a_peer_is_still_busy(job):
    error, seconds = asyncio.run(call(job, ("fail_at_once", "value"), ("hang", 2 * PEER_DEATH_GRACE_S)))
    assert type(error) is ValueError and seconds < PEER_DEATH_GRACE_S
    assert job.state is JobState.RUNNING


def test_an_internal_error_waits_at_most_the_grace_for_a_peer_that_neither_answers_nor_dies(job):
    error, seconds = asyncio.run(call(job, ("fail_at_once", "runtime"), ("hang", 3 * PEER_DEATH_GRACE_S)))
    assert type(error) is RuntimeError and PEER_DEATH_GRACE_S * 0.9 < seconds < PEER_DEATH_GRACE_S * 2
    assert job.state is JobState.RUNNING
