"""A model's queue measured without consuming it, so a worker can weigh a model it does not serve
yet: reading jobs it cannot run soon would strand them in its pending list.

Works on Redis 6.2 (no XINFO GROUPS lag there): waiting = XLEN - pending (workers delete entries
once finished, so the stream holds only queued and running jobs) plus pending entries idle past the
claim time (their worker died; the next worker to serve the model takes them over). The oldest
waiting job's age comes from its stream id, which starts with the ms time it was added. A model's
queue is its streams of both priority classes together, each class's shared stream and (interactive)
every worker's routed stream (shared/model_queues.py): batch work is work to switch for too, and so
are jobs routed to a worker of the model that cannot take them as fast as they come.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.model_queues import model_queues
from shared.schema import PRIORITIES
from worker.switching.switch_policy import QueueState


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


async def probe_queue(redis: Redis, model: str, *, now_ms: int, claim_idle_ms: int) -> QueueState:
    states = [
        await _probe_stream(redis, stream, now_ms=now_ms, claim_idle_ms=claim_idle_ms)
        for priority in PRIORITIES
        for stream in await model_queues(redis, model, priority)
    ]
    return QueueState(sum(s.waiting for s in states), max(s.oldest_wait_s for s in states))


async def _probe_stream(redis: Redis, stream: str, *, now_ms: int, claim_idle_ms: int) -> QueueState:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        results = await pipe.execute(raise_on_error=False)
    length, groups = results
    if isinstance(length, ResponseError) or not length:
        return QueueState(0, 0.0)
    group = (
        None
        if isinstance(groups, ResponseError)
        else next((g for g in groups if g["name"] in (keys.WORKER_GROUP, keys.WORKER_GROUP.encode())), None)
    )
    if group is None:  # no worker has ever read it: every entry waits
        first = await redis.xrange(stream, count=1)
        oldest = _entry_ms(first[0][0]) if first else now_ms
        return QueueState(length, max(0, now_ms - oldest) / 1000)
    pending = group["pending"]
    undelivered = await redis.xrange(stream, min=f"({_id_text(group['last-delivered-id'])}", count=1)
    abandoned = await redis.xpending_range(
        stream, keys.WORKER_GROUP, min="-", max="+", count=length, idle=claim_idle_ms
    )
    waiting = max(0, length - pending) + len(abandoned)
    oldest_ms = [_entry_ms(undelivered[0][0])] if undelivered else []
    oldest_ms += [_entry_ms(entry["message_id"]) for entry in abandoned[:1]]
    oldest = min(oldest_ms, default=now_ms)
    return QueueState(waiting, max(0, now_ms - oldest) / 1000 if waiting else 0.0)


def _id_text(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
