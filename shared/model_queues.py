"""A model's queue of one priority class as a whole: the class's shared stream and, for interactive
jobs (the class routing places, gateway/routing.py), every worker's routed stream.

What scaling and `/metrics` count: the entries of all of them (queued + running). The list of
worker streams is `lf:wqs:{model}`, kept by the workers and by the gateway's create script.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import keys
from shared.schema import Priority


async def model_queues(redis: Redis, model: str, priority: Priority = Priority.INTERACTIVE) -> list[str]:
    """The shared stream of `model`'s class `priority`, then (interactive only) each worker stream listed."""
    if priority is not Priority.INTERACTIVE:
        return [keys.queue(model, priority)]
    members = await redis.smembers(keys.worker_queues(model))
    return [keys.queue(model), *sorted(member.decode() for member in members)]


async def model_queue_depth(redis: Redis, model: str, priority: Priority) -> tuple[int, int | None]:
    """Entries over all of the class's streams of `model` (a missing stream counts 0), and the unix ms the
    oldest of them was added at (None when they are all empty): a stream id starts with that ms."""
    streams = await model_queues(redis, model, priority)
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
            pipe.xrange(stream, count=1)
        replies = await pipe.execute()
    oldest = [int(first[0][0].split(b"-")[0]) for first in replies[1::2] if first]
    return sum(replies[::2]), min(oldest, default=None)
