"""A model's queue as a whole: its shared stream and every worker's routed stream (gateway/routing.py).

What scaling and `/metrics` count: the entries of all of them (queued + running). The list of
worker streams is `lf:wqs:{model}`, kept by the workers and by the gateway's create script.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import keys


async def model_queues(redis: Redis, model: str) -> list[str]:
    """The shared stream of `model`, then each worker stream listed for it."""
    members = await redis.smembers(keys.worker_queues(model))
    return [keys.queue(model), *sorted(member.decode() for member in members)]


async def model_queue_length(redis: Redis, model: str) -> int:
    """Entries over all of `model`'s streams (a missing stream counts 0)."""
    streams = await model_queues(redis, model)
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
        return sum(await pipe.execute())
