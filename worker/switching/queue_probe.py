"""A model's queue measured without consuming it, so a worker can weigh a model it does not serve
yet: reading jobs it cannot run soon would strand them in its pending list.

Works on Redis 6.2 (no XINFO GROUPS lag there): waiting = XLEN - pending (workers delete entries
once finished, so the stream holds only queued and running jobs) plus pending entries idle past the
claim time (their worker died; the next worker to serve the model takes them over). The oldest
waiting job's age comes from its stream id, which starts with the ms time it was added. A model's
queue is its streams of both priority classes together, each class's shared stream and (interactive)
every worker's routed stream (shared/model_queues.py): batch work is work to switch for too, and so
are jobs routed to a worker of the model that cannot take them as fast as they come.

Each stream is measured by one script, so the figures are of one moment: a routed stream may be
handed over and deleted (worker/routed_streams.py) at any point after the list of streams was read,
and then it simply holds nothing.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import keys
from shared.model_queues import model_queues
from shared.schema import PRIORITIES
from worker.job_stream import GROUP_FIELDS_LUA
from worker.switching.switch_policy import QueueState

_PROBE_STREAM = (
    GROUP_FIELDS_LUA
    + f"""
-- KEYS: a stream   ARGV: claim_idle_ms
-- Returns {{entries waiting, the ms the oldest of them was added at (-1: none waits)}}.
local length = redis.call('XLEN', KEYS[1])
if length == 0 then return {{0, -1}} end
local function added_ms(entry_id) return tonumber(string.match(entry_id, '^%d+')) end
local group = group_fields(KEYS[1])
if group == nil then  -- no worker has ever read it: every entry waits
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
  return {{length, added_ms(first[1][1])}}
end
local undelivered = redis.call('XRANGE', KEYS[1], '(' .. group['last-delivered-id'], '+', 'COUNT', 1)
local abandoned = redis.call('XPENDING', KEYS[1], '{keys.WORKER_GROUP}', 'IDLE', ARGV[1], '-', '+', length)
local waiting = math.max(0, length - group['pending']) + #abandoned
local oldest = -1
if #undelivered > 0 then oldest = added_ms(undelivered[1][1]) end
if #abandoned > 0 and (oldest < 0 or added_ms(abandoned[1][1]) < oldest) then oldest = added_ms(abandoned[1][1]) end
if waiting == 0 then oldest = -1 end
return {{waiting, oldest}}
"""
)


class QueueProbe:
    """Measures models' queues for one worker; the script is registered once, not at every probe (the
    switcher probes each model four times a second)."""

    def __init__(self, redis: Redis, *, claim_idle_ms: int) -> None:
        self._redis = redis
        self._claim_idle_ms = claim_idle_ms
        self._probe_stream = redis.register_script(_PROBE_STREAM)

    async def measure(self, model: str, *, now_ms: int) -> QueueState:
        """`model`'s jobs waiting over all its streams, and how long the oldest has waited at `now_ms`."""
        states = []
        for priority in PRIORITIES:
            for stream in await model_queues(self._redis, model, priority):
                waiting, oldest_ms = await self._probe_stream(keys=[stream], args=[self._claim_idle_ms])
                states.append(QueueState(waiting, max(0, now_ms - oldest_ms) / 1000 if oldest_ms >= 0 else 0.0))
        return QueueState(sum(s.waiting for s in states), max(s.oldest_wait_s for s in states))
