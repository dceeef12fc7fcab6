"""Every job event stream this gateway process's clients wait on (long-polls, SSE streams), read by
one blocking XREAD on one Redis connection.

A blocking XREAD holds its Redis connection until an event arrives. With one per waiting client, a
gateway needs as many connections as clients wait, and redis-py's pool refuses the 101st (its
default cap): under load, submits and polls then failed with `MaxConnectionsError` (seen as 500s by
bench/e2e's tiny preset at 134 requests/s). Here the reader task blocks on all subscribed streams at
once, plus this process's wake stream: a subscription to a stream not yet in the read writes to the
wake stream, so the blocked read returns and starts over with it. Connections stay at one for all
waiting clients, plus the pool's for commands.

Entry ids are compared as (milliseconds, sequence): a stream read from the oldest position any
subscriber needs hands each subscriber only the entries past its own position.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import keys
from shared.tasks import TASK_STOP_S, cancel_and_wait

log = structlog.get_logger(__name__)

Entry = tuple[bytes, dict[bytes, bytes]]  # (stream entry id, fields)

_WAKE_TTL_MS = 60_000  # the wake stream of a gateway that died goes away by itself
_READ_RETRY_S = 0.5  # after a failed read (Redis away): the client's own retries have run out


def _position(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False, slots=True)
class Subscription:
    """One client's view of one job's events: entries past `after`, as they arrive."""

    after: tuple[int, int]
    _batches: asyncio.Queue[list[Entry]] = field(default_factory=asyncio.Queue)

    async def next(self, timeout_s: float) -> list[Entry]:
        """The next entries (in order), waiting up to `timeout_s`; [] if none came."""
        try:
            return await asyncio.wait_for(self._batches.get(), timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return []

    def _deliver(self, entries: list[Entry]) -> None:
        fresh = [entry for entry in entries if _position(entry[0]) > self.after]
        if fresh:
            self.after = _position(fresh[-1][0])
            self._batches.put_nowait(fresh)


class JobEventReader:
    def __init__(self, redis: Redis, *, block_ms: int) -> None:
        """`block_ms`: the longest single XREAD BLOCK; it must fit in the client's socket timeout."""
        self._redis = redis
        self._block_ms = block_ms
        self._wake_key = keys.gateway_wake(uuid.uuid4().hex)
        self._wake_after = "0-0"
        self._subscribers: dict[bytes, set[Subscription]] = {}
        self._reading: dict[bytes, tuple[int, int]] = {}  # stream → position the XREAD in flight reads it from
        self._changed = asyncio.Event()  # a subscription came while no read was in flight
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._read_forever(), name="job-events")

    async def close(self) -> None:
        self._closed = True  # redis-py may turn the cancellation of a blocked read into a RedisError
        if self._task is not None:
            await cancel_and_wait([self._task], TASK_STOP_S)

    @contextlib.asynccontextmanager
    async def subscribe(self, job_id: str, after: str = "0-0") -> AsyncIterator[Subscription]:
        """The job's events past stream entry `after`, for as long as the block runs."""
        key = keys.job_events(job_id).encode()
        subscription = Subscription(_position(after))
        self._subscribers.setdefault(key, set()).add(subscription)
        try:
            reading_from = self._reading.get(key)
            if reading_from is None or reading_from > subscription.after:
                await self._wake()  # the read in flight would miss this subscription's first entries
            yield subscription
        finally:
            subscribers = self._subscribers.get(key)
            if subscribers is not None:
                subscribers.discard(subscription)
                if not subscribers:
                    del self._subscribers[key]

    async def _wake(self) -> None:
        self._changed.set()
        if self._reading:  # a read is blocked on other streams: make it return
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=16, approximate=True)
                pipe.pexpire(self._wake_key, _WAKE_TTL_MS)
                await pipe.execute()

    async def _read_forever(self) -> None:
        while not self._closed:
            if not self._subscribers:
                await self._changed.wait()
            self._changed.clear()
            self._reading = {key: min(s.after for s in subscribers) for key, subscribers in self._subscribers.items()}
            streams = {self._wake_key: self._wake_after}
            streams |= {key: f"{ms}-{seq}" for key, (ms, seq) in self._reading.items()}
            try:
                reply = await self._redis.xread(streams, block=self._block_ms)
            except RedisError as exc:  # Redis away past the client's retries: the waiters time out meanwhile
                if self._closed:
                    return
                log.warning("job_events_read_failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(_READ_RETRY_S)
                continue
            finally:
                self._reading = {}
            for key, entries in reply or []:
                if key == self._wake_key.encode():
                    self._wake_after = entries[-1][0].decode()
                    continue
                for subscription in tuple(self._subscribers.get(key, ())):
                    subscription._deliver(entries)
