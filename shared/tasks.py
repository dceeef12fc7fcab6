"""Stopping background tasks without hanging on one that ignores its cancellation.

A cancellation can be lost: redis-py's asyncio client, given a socket timeout, sends each command
through `asyncio.wait_for`, and Python 3.11's wait_for returns the send's result instead of raising
when the cancellation lands as the send completes (CPython gh-86296, fixed in 3.12). The task then
goes on, often into its next loop, with `cancelling()` still counting the request. So a stop
cancels again every RECANCEL_S while it waits, and past its time leaves the task behind (logged)
rather than wait on it: a process that stops must not hang, nor keep a loop (a heartbeat) going.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

log = structlog.get_logger(__name__)

RECANCEL_S = 0.1
TASK_STOP_S = 2.0  # how long a process's stop waits for a cancelled loop: a cancelled read or sleep ends at once


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float) -> set[asyncio.Task]:
    """Cancel `tasks` and wait up to `timeout_s` for them to end; returns those that did not (left running)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(remaining, RECANCEL_S))
    for task in pending:
        log.error("task_ignored_cancellation", task=task.get_name(), waited_s=timeout_s)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a loop's failure is its owner's to report, not asyncio's at exit
    return pending
