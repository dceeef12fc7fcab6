"""What coroutines ask for in one event-loop turn, handed over together at the turn's end.

Concurrent requests each need a small piece of work whose fixed cost dwarfs its own (a Redis round
trip, a tokenizer call that finds its tables out of the CPU caches). Each caller adds its item and
awaits its own future; the first item of a turn schedules one flush with `call_soon`, which runs after
every coroutine of that turn has had its say, and gets the whole batch. `settle` then gives each
caller its result, or its own error, skipping callers that went away meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")
Batch = list[tuple[Item, asyncio.Future[Result]]]


class TurnBatch(Generic[Item, Result]):
    def __init__(self, flush: Callable[[Batch[Item, Result]], None]) -> None:
        """`flush(batch)` runs at the end of each turn in which items were added, on the loop; it must
        settle every future of the batch (now, or from a task it starts)."""
        self._flush = flush
        self._pending: Batch[Item, Result] = []
        # the loop of the turn being collected, looked up by its first item only: on Python 3.11
        # get_running_loop makes a getpid system call
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, item: Item) -> asyncio.Future[Result]:
        if not self._pending:
            self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._hand_over)
        assert self._loop is not None
        future: asyncio.Future[Result] = self._loop.create_future()
        self._pending.append((item, future))
        return future

    def _hand_over(self) -> None:
        batch, self._pending = self._pending, []
        self._flush(batch)


def settle(batch: Batch[Item, Result], results: Sequence[Result | Exception]) -> None:
    """Give each future of `batch` its result, an Exception being raised to that caller alone; a
    future already done (its caller went away) is left as it is."""
    for (_, future), result in zip(batch, results, strict=True):
        if future.done():
            continue
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
