"""Stopping background tasks never hangs on one that ignores its cancellation, and ends one that lost a
cancellation (as redis-py may swallow one) by cancelling it again."""

from __future__ import annotations

import asyncio
import time

from shared.tasks import cancel_and_wait


async def swallows_cancellations(times: list[int], swallowed: list[int]) -> None:
    """Goes on after its first `times[0]` cancellations, as a loop whose command swallowed them does."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if len(swallowed) >= times[0]:
                raise
            swallowed.append(1)
            asyncio.current_task().uncancel()


async def test_tasks_that_honour_cancellation_end_at_once():
    tasks = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    started = time.monotonic()
    assert await cancel_and_wait(tasks, timeout_s=5.0) == set()
    assert all(task.cancelled() for task in tasks)
    assert time.monotonic() - started < 1.0


async def test_a_task_that_lost_a_cancellation_is_cancelled_again_until_it_ends():
    swallowed: list[int] = []
    task = asyncio.create_task(swallows_cancellations([3], swallowed))
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=5.0) == set()
    assert task.cancelled() and len(swallowed) == 3


async def test_a_task_that_ignores_every_cancellation_is_left_behind_after_the_timeout():
    swallowed: list[int] = []
    forever = [10**9]
    task = asyncio.create_task(swallows_cancellations(forever, swallowed))
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await cancel_and_wait([task], timeout_s=0.3) == {task}
    assert 0.3 <= time.monotonic() - started < 1.0
    assert not task.done() and swallowed
    forever[0] = 0  # the test's own clean-up
    assert await cancel_and_wait([task], timeout_s=1.0) == set()


async def test_finished_and_failed_tasks_are_no_obstacle():
    async def fail() -> None:
        raise RuntimeError("loop failed")

    failed, finished = asyncio.create_task(fail()), asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    assert await cancel_and_wait([failed, finished], timeout_s=1.0) == set()
