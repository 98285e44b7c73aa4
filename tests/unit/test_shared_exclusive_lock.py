"""The sampling job's lock: a waiting weight load is not starved by generate calls that keep arriving."""

import asyncio

from arctic_rl_core.server.sampling_job import SharedExclusiveLock


def test_shared_callers_arriving_after_a_waiting_exclusive_one_queue_behind_it():
    async def scenario() -> list[str]:
        lock, order = SharedExclusiveLock(), []
        first_in, release_first = asyncio.Event(), asyncio.Event()

        async def first_shared():
            async with lock.shared():
                first_in.set()
                await release_first.wait()
                order.append("shared 1 done")

        async def exclusive():
            async with lock.exclusive():
                order.append("exclusive")

        async def late_shared():
            async with lock.shared():
                order.append("shared 2")

        tasks = [asyncio.ensure_future(first_shared())]
        await first_in.wait()
        tasks.append(asyncio.ensure_future(exclusive()))
        await asyncio.sleep(0.01)  # the exclusive caller is waiting for the first shared one
        tasks.append(asyncio.ensure_future(late_shared()))
        await asyncio.sleep(0.01)
        assert order == []  # the late shared caller did not overtake the waiting exclusive one
        release_first.set()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["shared 1 done", "exclusive", "shared 2"]


def test_a_cancelled_exclusive_waiter_lets_the_shared_callers_it_held_back_go():
    async def scenario() -> bool:
        lock = SharedExclusiveLock()
        holding, release = asyncio.Event(), asyncio.Event()

        async def holder():
            async with lock.shared():
                holding.set()
                await release.wait()

        async def exclusive():
            async with lock.exclusive():
                pass

        held = asyncio.ensure_future(holder())
        await holding.wait()
        waiter = asyncio.ensure_future(exclusive())
        await asyncio.sleep(0.01)
        waiter.cancel()

        async def late_shared():
            async with lock.shared():
                return True

        entered = await asyncio.wait_for(late_shared(), timeout=1.0)
        release.set()
        await held
        return entered

    assert asyncio.run(scenario())
