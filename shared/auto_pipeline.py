"""Auto-pipelining: the commands that coroutines issue in one event-loop turn go to Redis as one
pipeline, so concurrent requests share one send, one read and redis-py's per-round-trip work.

Each caller still waits for its own reply, and a command's error (e.g. NOSCRIPT) goes to its caller
alone. Only non-blocking commands belong here: a blocking read (XREAD BLOCK) would hold up every
command batched with it. It offers the few methods its users call (`hgetall`, and `evalsha` /
`script_load` so that a registered Script runs through it: `script(keys, args, client=pipeline)`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis


class AutoPipeline:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._flushes: set[asyncio.Task[None]] = set()

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return await self._execute("HGETALL", key)

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return await self._execute("EVALSHA", sha, numkeys, *keys_and_args)

    async def script_load(self, script: str) -> str:
        return await self._redis.script_load(script)

    def _execute(self, *args: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)  # after every coroutine that runs in this turn has had its say
        self._pending.append((args, reply))
        return reply

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._flushes.add(task)  # held, so the task is not collected mid-flight
        task.add_done_callback(self._flushes.discard)

    async def _send(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for args, _ in batch:
                    pipe.execute_command(*args)
                replies = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:  # the process is stopping
            for _, reply in batch:
                reply.cancel()
            raise
        except Exception as exc:  # the connection failed past the client's retries
            for _, reply in batch:
                if not reply.done():
                    reply.set_exception(exc)
            return
        for (_, reply), result in zip(batch, replies, strict=True):
            if reply.done():  # its caller went away
                continue
            if isinstance(result, Exception):
                reply.set_exception(result)
            else:
                reply.set_result(result)
