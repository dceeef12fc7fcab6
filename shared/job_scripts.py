"""The job store's Lua scripts: their source text, and their registration on a Redis client.

Every status change of a job is one of these scripts (shared/jobstore.py runs them), so a cancel
racing a finish, or a job redelivered after a worker crash, can never overwrite a terminal state.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from shared import keys
from shared.rate_limits import ADMIT_LUA

CREATE_LUA = (
    ADMIT_LUA
    + """
-- KEYS: job hash, the job's queue (the model's shared stream or a worker's), idempotency key, the model's
-- worker streams (set), then the admit function's keys when admitting
-- ARGV: payload, then one msgpack array: use_idem, ttl_s, job_id, record [field, value, ...], admit's
-- args (nil: no admission), routed (the queue is a worker's stream: listed, so that it is never stranded)
local use_idem, ttl_s, job_id, record, admit_args, routed = unpack(cmsgpack.unpack(ARGV[2]), 1, 6)
if use_idem then
  local existing = redis.call('GET', KEYS[3])
  if existing then return {0, existing} end
end
if admit_args then
  local verdict = admit({unpack(KEYS, 5)}, admit_args)
  if verdict[1] ~= 'ok' then return {2, verdict[1], verdict[2], verdict[3]} end
end
redis.call('HSET', KEYS[1], unpack(record))
redis.call('EXPIRE', KEYS[1], ttl_s)
local entry_id = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
if routed then redis.call('SADD', KEYS[4], KEYS[2]) end
if use_idem then redis.call('SET', KEYS[3], job_id, 'EX', ttl_s) end
return {1, job_id, entry_id}
"""
)

WITHDRAW_LUA = """
-- KEYS: job hash, model queue, idempotency key, tenant's active set, job events
-- ARGV: job id, queue entry id, use_idem
-- Undo a creation no replica confirmed. A worker may have started the job meanwhile: it finds the record
-- gone, stops the job and acknowledges its entry, as for an expired record.
redis.call('DEL', KEYS[1], KEYS[5])
redis.call('XDEL', KEYS[2], ARGV[2])
if ARGV[3] == '1' and redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""

START_LUA = """
-- KEYS: job hash   ARGV: worker id, now_ms
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing', 0} end
if status == 'queued' or status == 'running' then
  -- counted first: attempts that are no integer fail the script before it writes anything
  local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
  redis.call('HSETNX', KEYS[1], 'started_ms', ARGV[2])
  return {'running', attempts}
end
return {status, redis.call('HGET', KEYS[1], 'attempts')}
"""

# Lua shared by the terminal transitions: queue the job's webhook, if it asked for one (KEYS[3]: lf:webhooks)
QUEUE_WEBHOOK_LUA = """
if redis.call('HEXISTS', KEYS[1], 'webhook') == 1 then
  redis.call('XADD', KEYS[3], '*', 'job', redis.call('HGET', KEYS[1], 'job_id'))
end
"""

FINISH_LUA = (
    f"""
-- KEYS: job hash, job events, webhooks[, job queue]   ARGV: ttl_s, new status, events cap, queue entry id
-- ('' with no queue), field/value...
-- With a queue, its entry is acknowledged (and deleted) in the same script: a result is never stored
-- without its ack nor acked without its result, whatever the primary that survives has of them.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then
  if KEYS[4] then
    redis.call('XACK', KEYS[4], '{keys.WORKER_GROUP}', ARGV[4])
    redis.call('XDEL', KEYS[4], ARGV[4])
  end
  return 0
end
-- an events key of another type fails the script before the record changes
local events = redis.call('TYPE', KEYS[2])['ok']
if events ~= 'stream' and events ~= 'none' then
  return redis.error_reply('WRONGTYPE the job events key holds ' .. events)
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[1])
-- the end event carries the final record: its reader has the result without reading the record again
local record = cmsgpack.pack(redis.call('HGETALL', KEYS[1]))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'type', 'end', 'status', ARGV[2], 'record', record)
redis.call('EXPIRE', KEYS[2], ARGV[1])
if KEYS[4] then
  redis.call('XACK', KEYS[4], '{keys.WORKER_GROUP}', ARGV[4])
  redis.call('XDEL', KEYS[4], ARGV[4])
end
"""
    + QUEUE_WEBHOOK_LUA
    + "return 1"
)

RELEASE_LUA = """
-- KEYS: job hash   ARGV: worker id
-- A draining worker hands a job it started back: queued again, and this delivery does not count.
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return 1
"""

CANCEL_LUA = (
    """
-- KEYS: job hash, job events, webhooks   ARGV: ttl_s, now_ms, events cap
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status ~= 'queued' and status ~= 'running' then return status end
redis.call('HSET', KEYS[1], 'status', 'canceled', 'finished_ms', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'type', 'end', 'status', 'canceled')
redis.call('EXPIRE', KEYS[2], ARGV[1])
"""
    + QUEUE_WEBHOOK_LUA
    + "return 'canceled'"
)


TOKENS_LUA = """
-- KEYS: the events stream of each token's job, one key per token
-- ARGV: ttl_s, events cap, then per token: text, token id, offset (of its text in the job's output)
-- Each token is its own XADD: an events key of another type fails that token alone (its error is returned),
-- the others are written all the same. A job's first event (offset 0) sets its stream's TTL, so a job
-- that never finishes leaves no stream behind.
local errors = {}
for i, key in ipairs(KEYS) do
  local at = 2 + (i - 1) * 3
  local offset = ARGV[at + 3]
  local added = redis.pcall('XADD', key, 'MAXLEN', '~', ARGV[2], '*', 'type', 'token', 'text', ARGV[at + 1],
    'token_ids', '[' .. ARGV[at + 2] .. ']', 'offset', offset)
  if type(added) == 'table' and added.err then
    errors[#errors + 1] = added.err
  elseif offset == '0' then
    redis.call('EXPIRE', key, ARGV[1])
  end
end
return errors
"""


@dataclass(frozen=True, slots=True)
class JobScripts:
    """The scripts registered on one client: each runs by EVALSHA, loading itself after NOSCRIPT."""

    create: AsyncScript
    withdraw: AsyncScript
    start: AsyncScript
    finish: AsyncScript
    release: AsyncScript
    cancel: AsyncScript


def register_job_scripts(redis: Redis) -> JobScripts:
    return JobScripts(
        create=redis.register_script(CREATE_LUA),
        withdraw=redis.register_script(WITHDRAW_LUA),
        start=redis.register_script(START_LUA),
        finish=redis.register_script(FINISH_LUA),
        release=redis.register_script(RELEASE_LUA),
        cancel=redis.register_script(CANCEL_LUA),
    )
