"""Auto-pipelining: the commands that coroutines issue in one event-loop turn go to Redis as one
pipeline (gateway/turn_batch.py), so concurrent requests share one send, one read and the
per-round-trip work.

Each caller still waits for its own reply, and a command's error (e.g. NOSCRIPT) goes to its caller
alone. Only non-blocking commands belong here: a blocking read (XREAD BLOCK) would hold up every
command batched with it. It offers the few methods its users call (`hgetall`, and `evalsha` /
`script_load` so that a registered Script runs through it: `script(keys, args, client=pipeline)`).

A batch is packed by hiredis's C packer and exchanged on one connection directly, not through
redis-py's Pipeline: redis-py's asyncio client packs every argument in Python (a submit's script has
25) and its pipeline adds per-call bookkeeping a batch of plain commands does not need.
The pipeline's client has no socket timeout, and a batch's exchange is timed as a whole: with one,
redis-py arms a timer for every reply it reads (and a task for every send), which cost about as much
as the rest of a reply's handling. Connections are taken from the client's pool once and kept for the
next batches: the pool's lending and taking back (a lock, a check for unread data, observability
events, each time) cost as much per batch as its reading. One that fails goes back to the pool.

Replica confirmation is group commit: every `wait_replicas` of a turn is answered by one WAIT, sent
on the batch's connection once the batch's replies are in (so reads are not held up by it), which
covers every write of the batch. A WAIT is never retried: on a fresh connection it would confirm
nothing (WAIT counts only the writes its own connection made), so a failed one fails its callers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hiredis import pack_command
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.turn_batch import TurnBatch, settle

_Batch = list[tuple[tuple[Any, ...], asyncio.Future[Any]]]  # (command arguments, the caller's reply)


class AutoPipeline:
    def __init__(self, redis: Redis, *, timeout_s: float) -> None:
        """`redis`: a client of its own without a socket timeout; a batch's exchange fails (and is retried
        by the client's retry policy) after `timeout_s`."""
        self._redis = redis
        self._timeout_s = timeout_s
        self._commands: TurnBatch[tuple[Any, ...], Any] = TurnBatch(self._flush)
        self._flushes: set[asyncio.Task[None]] = set()
        self._idle: list[AbstractConnection] = []  # connections kept from the pool, in step, between batches

    # the commands answer the caller's future itself, awaited as redis-py's coroutines are: a coroutine
    # around it would be one more frame to create and to pass through on every reply
    def hgetall(self, key: str) -> asyncio.Future[dict[bytes, bytes]]:
        return self._commands.add(("HGETALL", key))  # a map: redis-py's clients speak RESP3

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> asyncio.Future[Any]:
        return self._commands.add(("EVALSHA", sha, numkeys, *keys_and_args))

    def wait_replicas(self, replicas: int, timeout_ms: int) -> asyncio.Future[int]:
        """How many replicas acknowledged every write of this turn's batch (WAIT): call it in the same
        turn as the writes it must cover."""
        return self._commands.add(("WAIT", replicas, timeout_ms))

    async def script_load(self, script: str) -> str:
        return await self._redis.script_load(script)

    def _flush(self, batch: _Batch) -> None:
        task = asyncio.ensure_future(self._send(batch))
        self._flushes.add(task)  # held, so the task is not collected mid-flight
        task.add_done_callback(self._flushes.discard)

    async def _send(self, batch: _Batch) -> None:
        waits = [entry for entry in batch if entry[0][0] == "WAIT"]
        if waits:
            batch = [entry for entry in batch if entry[0][0] != "WAIT"]
        pool = self._redis.connection_pool
        try:
            connection = self._idle.pop() if self._idle else await pool.get_connection()
            try:
                # a connection error or timeout disconnects, then the client's retry policy sends again
                replies = await connection.retry.call_with_retry(
                    lambda: _exchange(connection, batch, self._timeout_s), lambda _error: connection.disconnect()
                )
                settle(batch, replies)
                if waits:  # on this connection, after the writes it covers; one WAIT answers them all
                    settle(waits, (await _exchange(connection, waits[:1], self._timeout_s)) * len(waits))
            except BaseException:  # maybe out of step: the pool checks a connection before it lends it again
                await pool.release(connection)
                raise
            self._idle.append(connection)
        except asyncio.CancelledError:  # the process is stopping
            for _, reply in batch + waits:
                reply.cancel()
            raise
        except Exception as exc:  # the connection failed past the client's retries
            for _, reply in batch + waits:
                if not reply.done():
                    reply.set_exception(exc)


async def _exchange(connection: AbstractConnection, batch: _Batch, timeout_s: float) -> list[Any]:
    """Send every command of `batch` in one write, then read all their replies (an error reply is
    returned in its place, so the connection stays in step); redis-py's TimeoutError after `timeout_s`
    (the connection is closed: an interrupted read leaves it out of step).

    Replies are read from the connection's parser (hiredis), not through `connection.read_response`:
    that wrapper (a timeout computed, the host's name formatted, a deprecated-arguments check and a
    protocol check, three coroutines a reply) cost more than the parsing, and what it adds is not
    needed here: the batch is timed as a whole, and a failed read disconnects in `_send`'s retry."""
    parser = connection._parser
    replies: list[Any] = []
    try:
        async with asyncio.timeout(timeout_s):
            await connection.send_packed_command(b"".join([pack_command(args) for args, _ in batch]))
            for _ in batch:
                replies.append(await parser.read_response())
    except TimeoutError:
        raise RedisTimeoutError(f"no reply from Redis within {timeout_s:g} s") from None
    except OSError as exc:  # as read_response would: the retry policy retries ConnectionErrors
        raise RedisConnectionError(f"error while reading from Redis: {exc!r}") from exc
    if any(isinstance(reply, ReadOnlyError) for reply in replies):
        # the server was demoted (a failover): no write of the batch ran, so it is sent again once the
        # connection, dropped, reconnects to the primary the Sentinels name now
        raise RedisConnectionError("Redis answered READONLY: the primary is now a replica")
    return replies
