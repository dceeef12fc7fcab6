"""The routed streams of a model, from a worker's side (gateway/routing.py places jobs on them), and the
read of a worker's streams that takes only its room, oldest first.

Each worker of a model reads the model's shared streams and its own stream `lf:wq:{model}:{worker}`,
where the gateway puts interactive jobs whose adapter this worker holds, or whose consistent-hash home
it is, and with the fleet full its bounded share of the backlog (batch jobs wait on the model's
shared batch stream `lf:qb:{model}`, never routed: they fill the room interactive work leaves,
wherever it is).
Every worker stream of a model is listed in `lf:wqs:{model}`, so any worker can reach the others':

- steal: a worker with free batch slots takes entries that have waited undelivered on another
  worker's stream longer than `steal_after_ms` (that worker is too busy to read them). One script
  reads only entries past the bound, so a worker that keeps up with its stream loses nothing to it;
- re-claim: the entries a dead worker had read are taken over by XAUTOCLAIM after `claim_idle_ms`,
  on its stream as on the shared one (the intake's claim pass covers every stream of the model);
- hand over: a worker that stops, and any worker that finds a stream whose owner's heartbeat is
  gone, moves the stream's undelivered entries to the shared interactive stream, and deletes the stream once it
  holds nothing. Entries another worker is running stay, and are acknowledged where they are.

Stream ids start with the Redis server's ms clock (the gateway adds entries with `*`), and the
scripts read the time from the server too, so a bound never depends on a worker's clock.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import keys
from shared.model_queues import model_queues
from shared.schema import Priority
from worker.job_stream import GROUP_FIELDS_LUA

# Lua shared by the scripts: the group's last delivered id, the group created (from the stream's
# start) when the stream has none: a stream the gateway created by its first entry has no group yet
_LAST_DELIVERED = (
    GROUP_FIELDS_LUA
    + f"""
local function last_delivered(stream)
  local group = group_fields(stream)
  if group then return group['last-delivered-id'] end
  redis.call('XGROUP', 'CREATE', stream, '{keys.WORKER_GROUP}', '0', 'MKSTREAM')
  return '0-0'
end
"""
)

_STEAL = (
    _LAST_DELIVERED
    + f"""
-- KEYS: another worker's stream   ARGV: this worker, count, steal_after_ms
-- Read (for this worker) up to `count` of the entries that have waited undelivered longer than the bound.
-- A stream handed over and deleted since it was listed is left deleted (the group is made with MKSTREAM).
if redis.call('EXISTS', KEYS[1]) == 0 then return {{}} end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local due = redis.call('XRANGE', KEYS[1], '(' .. last_delivered(KEYS[1]), tostring(now_ms - tonumber(ARGV[3])),
  'COUNT', ARGV[2])
if #due == 0 then return {{}} end
local read = redis.call('XREADGROUP', 'GROUP', '{keys.WORKER_GROUP}', ARGV[1], 'COUNT', #due, 'STREAMS', KEYS[1], '>')
return read[1][2]
"""
)

_READ_OLDEST = (
    _LAST_DELIVERED
    + f"""
-- KEYS: streams   ARGV: this worker, count
-- Read (for this worker) the `count` oldest undelivered entries over all the streams, by id (the ms each was
-- added at, then its sequence). A stream that does not exist is skipped: one handed over and deleted stays so.
local count = tonumber(ARGV[2])
local waiting = {{}}
for index, stream in ipairs(KEYS) do
  if redis.call('EXISTS', stream) == 1 then
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last_delivered(stream), '+', 'COUNT', count)) do
      local ms, seq = string.match(entry[1], '^(%d+)-(%d+)$')
      table.insert(waiting, {{tonumber(ms), tonumber(seq), index}})
    end
  end
end
table.sort(waiting, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
local taken = {{}}
for i = 1, math.min(count, #waiting) do taken[waiting[i][3]] = (taken[waiting[i][3]] or 0) + 1 end
local read = {{}}
for index, stream in ipairs(KEYS) do
  if taken[index] then
    local reply = redis.call('XREADGROUP', 'GROUP', '{keys.WORKER_GROUP}', ARGV[1], 'COUNT', taken[index],
      'STREAMS', stream, '>')
    table.insert(read, {{stream, reply[1][2]}})
  end
end
return read
"""
)

_HAND_OVER = (
    _LAST_DELIVERED
    + """
-- KEYS: a worker's stream, the model's shared stream, the model's worker streams (set), the owner's heartbeat
-- ARGV: '1' to do it only if the owner's heartbeat is gone
-- Move the undelivered entries to the shared stream; delete the stream once nothing is left in it.
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then return -1 end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], KEYS[1])
  return 0
end
local undelivered = redis.call('XRANGE', KEYS[1], '(' .. last_delivered(KEYS[1]), '+')
for _, entry in ipairs(undelivered) do
  redis.call('XADD', KEYS[2], '*', unpack(entry[2]))
  redis.call('XDEL', KEYS[1], entry[1])
end
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], KEYS[1])
end
return #undelivered
"""
)

Entries = list[tuple[bytes, dict[bytes, bytes]]]


def owner_of(model: str, stream: str) -> str:
    """The worker whose stream `stream` is."""
    return stream.removeprefix(keys.worker_queue(model, ""))


class RoutedStreams:
    """One worker's view of its models' routed streams."""

    def __init__(self, redis: Redis, worker_id: str) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._steal = redis.register_script(_STEAL)
        self._read_oldest = redis.register_script(_READ_OLDEST)
        self._hand_over = redis.register_script(_HAND_OVER)

    def own(self, model: str) -> str:
        return keys.worker_queue(model, self._worker_id)

    async def of_model(self, model: str, priority: Priority = Priority.INTERACTIVE) -> list[str]:
        """Every stream a job of `model`'s class `priority` may wait on: the shared one, then (interactive
        jobs, the ones routed) each worker's."""
        return await model_queues(self._redis, model, priority)

    async def register(self, model: str) -> None:
        """List this worker's stream of `model` (again: a restarted Redis may have lost the set), with its group."""
        stream = self.own(model)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.sadd(keys.worker_queues(model), stream)
            pipe.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            await pipe.execute(raise_on_error=False)  # BUSYGROUP: it exists already

    async def read_oldest(self, streams: list[str], count: int) -> list[tuple[str, Entries]]:
        """Up to `count` undelivered entries of `streams` (a model's shared and routed streams, of any models),
        the oldest over all of them first, now pending for this worker, as (stream, entries) pairs: one
        XREADGROUP of several streams takes its COUNT from each, so a worker reading them that way could
        take several times its room, and the newest entries of one stream before older ones of another."""
        read = await self._read_oldest(keys=streams, args=[self._worker_id, count])
        return [(stream.decode(), [(entry, _fields(flat)) for entry, flat in entries]) for stream, entries in read]

    async def steal(self, model: str, count: int, steal_after_ms: int) -> list[tuple[str, Entries]]:
        """Up to `count` entries that waited on other workers' streams of `model` past the bound, as
        (stream, entries) pairs, now pending for this worker."""
        stolen: list[tuple[str, Entries]] = []
        for stream in await self.of_model(model):
            if count <= 0:
                break
            if stream in (keys.queue(model), self.own(model)):
                continue
            entries = await self._steal(keys=[stream], args=[self._worker_id, count, steal_after_ms])
            entries = [(entry_id, _fields(flat)) for entry_id, flat in entries if flat]
            if entries:
                stolen.append((stream, entries))
                count -= len(entries)
        return stolen

    async def hand_over_own(self, model: str) -> int:
        """At stop: this worker's undelivered entries of `model` go to the shared stream. Returns how many."""
        return await self._run_hand_over(model, self.own(model), only_if_owner_gone=False)

    async def adopt_orphans(self, model: str) -> int:
        """The undelivered entries on streams of `model` whose worker's heartbeat is gone go to the shared
        stream (their running entries are re-claimed by XAUTOCLAIM). Returns how many moved."""
        moved = 0
        for stream in await self.of_model(model):
            if stream not in (keys.queue(model), self.own(model)):
                moved += max(0, await self._run_hand_over(model, stream, only_if_owner_gone=True))
        return moved

    async def _run_hand_over(self, model: str, stream: str, *, only_if_owner_gone: bool) -> int:
        script_keys = [stream, keys.queue(model), keys.worker_queues(model), keys.worker(owner_of(model, stream))]
        return int(await self._hand_over(keys=script_keys, args=["1" if only_if_owner_gone else "0"]))


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    """A script's reply for an entry's fields, [name, value, ...], as XREADGROUP's dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
