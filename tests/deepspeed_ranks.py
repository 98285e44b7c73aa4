"""Real DeepSpeed ranks (gloo, CPU) in spawned processes, for tests of what ranks must run in step.

ZeRO-3 gathers parameters in every forward, and those gathers are collectives: a rank that runs
fewer of them than another leaves it waiting forever. So a rank reports each call it finished,
and a test reads the reports collected before a deadline: a hang shows as a missing report.
"""

from __future__ import annotations

import queue
import time

import torch.multiprocessing as mp

from tests.conftest import free_port


def run_ranks(target, args: tuple, reports: int, deadline_s: float, world_size: int = 2) -> dict:
    """``{(rank, what): value}`` from ``target(rank, port, *args, results)`` run in each rank.

    A rank puts ``(rank, what, value)`` on ``results`` per finished call, and ``(rank, "error", text)``
    on an exception. Collection stops after ``reports`` reports, at the first error, or at the deadline.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=target, args=(r, port, *args, results), daemon=True) for r in range(world_size)]
    for process in ranks:
        process.start()
    got: dict = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(got) < reports and time.monotonic() < deadline and not any(k[1] == "error" for k in got):
            try:
                rank, what, value = results.get(timeout=1)
            except queue.Empty:
                continue
            got[(rank, what)] = value
    finally:
        for process in ranks:
            process.kill()
            process.join()
    return got
