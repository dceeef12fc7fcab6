"""Job state in Redis: creation, the worker's start and finish, cancel, and long-poll waits.

Every status change is one Lua script, so a cancel racing a finish, or a job redelivered after a
worker crash, can never overwrite a terminal state: the first terminal write wins and the job has
exactly one stored result. The same script that writes the terminal state queues the job's webhook
(if it has one) on `lf:webhooks`, so a webhook is queued exactly once, whoever ends the job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from typing import Any, Protocol

import msgpack
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from shared import keys
from shared.rate_limits import ADMIT_LUA, AdmissionCheck, AdmissionDenied, denial
from shared.schema import (
    JobError,
    JobMessage,
    JobOutput,
    JobRecord,
    JobStatus,
    SchemaError,
    TokenDelta,
    decode_status,
    encode_job,
    encode_output,
)

_CREATE = (
    ADMIT_LUA
    + """
-- KEYS: job hash, model queue, idempotency key, then the admit function's keys when admitting
-- ARGV: payload, then one msgpack array: use_idem, ttl_s, job_id, record [field, value, ...], admit's
-- args (nil: no admission)
local use_idem, ttl_s, job_id, record, admit_args = unpack(cmsgpack.unpack(ARGV[2]), 1, 5)
if use_idem then
  local existing = redis.call('GET', KEYS[3])
  if existing then return {0, existing} end
end
if admit_args then
  local verdict = admit({unpack(KEYS, 4)}, admit_args)
  if verdict[1] ~= 'ok' then return {2, verdict[1], verdict[2], verdict[3]} end
end
redis.call('HSET', KEYS[1], unpack(record))
redis.call('EXPIRE', KEYS[1], ttl_s)
redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
if use_idem then redis.call('SET', KEYS[3], job_id, 'EX', ttl_s) end
return {1, job_id}
"""
)

_START = """
-- KEYS: job hash   ARGV: worker id, now_ms
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing', 0} end
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
  redis.call('HSETNX', KEYS[1], 'started_ms', ARGV[2])
  return {'running', redis.call('HINCRBY', KEYS[1], 'attempts', 1)}
end
return {status, redis.call('HGET', KEYS[1], 'attempts')}
"""

# Lua shared by the terminal transitions: queue the job's webhook, if it asked for one (KEYS[3]: lf:webhooks)
_QUEUE_WEBHOOK = """
if redis.call('HEXISTS', KEYS[1], 'webhook') == 1 then
  redis.call('XADD', KEYS[3], '*', 'job', redis.call('HGET', KEYS[1], 'job_id'))
end
"""

_FINISH = (
    """
-- KEYS: job hash, job events, webhooks   ARGV: ttl_s, new status, events cap, field/value...
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'type', 'end', 'status', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[1])
"""
    + _QUEUE_WEBHOOK
    + "return 1"
)

_RELEASE = """
-- KEYS: job hash   ARGV: worker id
-- A draining worker hands a job it started back: queued again, and this delivery does not count.
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return 1
"""

_CANCEL = (
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
    + _QUEUE_WEBHOOK
    + "return 'canceled'"
)


class BatchedClient(Protocol):
    """What `create` and `get` need of their client: a Redis client, or a gateway's auto-pipeline
    (gateway/auto_pipeline.py), which sends the commands of one event-loop turn together."""

    def hgetall(self, key: str) -> Awaitable[dict[bytes, bytes]]: ...

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]: ...

    async def script_load(self, script: str) -> str: ...


# Events kept per job stream (approximately): a streaming reader further behind than this misses
# token events; the offsets in the rest (and the final record) let it notice and recover the text.
EVENTS_CAP = 1000


async def _load_and_run(client: BatchedClient, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
    """After NOSCRIPT (a restarted Redis): load the script, then send its EVALSHA again."""
    script.sha = await client.script_load(script.script)
    return await client.evalsha(script.sha, len(keys), *keys, *args)


def now_ms() -> int:
    return int(time.time() * 1000)


class JobStore:
    """Owns the `lf:job:*` hashes and `lf:out:*` event streams; queues are written only through `create`."""

    def __init__(self, redis: Redis, job_ttl_s: int, *, batched: BatchedClient | None = None) -> None:
        """`batched`: send `create` and `get` through this auto-pipeline (a gateway's many concurrent
        requests then share Redis round trips); otherwise every call is its own round trip."""
        self._redis = redis
        self._batched: BatchedClient = batched or redis
        self._ttl_s = job_ttl_s
        self._create = redis.register_script(_CREATE)
        self._start = redis.register_script(_START)
        self._finish = redis.register_script(_FINISH)
        self._release = redis.register_script(_RELEASE)
        self._cancel = redis.register_script(_CANCEL)

    async def create(
        self,
        record: JobRecord,
        message: JobMessage,
        idempotency_key: str | None = None,
        admission: AdmissionCheck | None = None,
    ) -> tuple[str, bool]:
        """Write the job hash, then its queue entry, atomically (one script, one round trip). Returns
        (job id, newly created); a repeated idempotency key returns the first job's id and queues
        nothing (nor is admitted again). With `admission`, the job is admitted first in the same script,
        and AdmissionDenied is raised, with nothing written, when it is not."""
        idem_key = keys.idempotency(record.tenant, idempotency_key) if idempotency_key else keys.job(record.job_id)
        # everything but the message travels as one msgpack argument: hiredis formats each argument's length
        # with sprintf, which cost more than msgpack's packing (bench/gateway.py)
        packed = msgpack.packb(
            [
                bool(idempotency_key),
                self._ttl_s,
                record.job_id,
                record.hset_fields(),
                admission.args if admission else None,
            ]
        )
        script_keys = [keys.job(record.job_id), keys.queue(record.model, message.priority), idem_key]
        script_keys += admission.keys if admission else ()
        script_args = [encode_job(message), packed]
        # EVALSHA awaited here, not through redis-py's Script call (an import and an isinstance check through
        # typing's Protocol machinery per call) nor a helper coroutine (one more frame to resume on the reply)
        try:
            reply = await self._batched.evalsha(self._create.sha, len(script_keys), *script_keys, *script_args)
        except NoScriptError:
            reply = await _load_and_run(self._batched, self._create, script_keys, script_args)
        if reply[0] == 2:
            raise AdmissionDenied(denial(*reply[1:]))
        created, job_id = reply
        return job_id.decode() if isinstance(job_id, bytes) else job_id, bool(created)

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record, None when there is none; SchemaError when it cannot be read as one."""
        try:
            raw = await self._batched.hgetall(keys.job(job_id))
        except ResponseError as exc:
            _raise_if_unreadable(job_id, exc)
            raise
        return JobRecord.from_hash(raw) if raw else None

    async def start(self, job_id: str, worker_id: str) -> tuple[JobStatus | None, int]:
        """Mark a job running on this worker; returns (status, attempts so far including this one).

        RUNNING: run it. A terminal status: skip it (canceled while queued, or already finished by
        an earlier delivery). None: the record has expired. SchemaError: the record cannot be read
        (not a hash, a status that is no JobStatus, attempts that are not a count).
        """
        try:
            status, attempts = await self._start(keys=[keys.job(job_id)], args=[worker_id, now_ms()])
        except ResponseError as exc:
            _raise_if_unreadable(job_id, exc)
            raise
        status = status.decode(errors="replace")
        try:
            attempts = int(attempts or 0)
        except ValueError as exc:
            raise SchemaError(f"job {job_id}: attempts {attempts!r:.40} is not an integer") from exc
        return (None if status == "missing" else decode_status(status)), attempts

    async def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        output: JobOutput | None = None,
        error: JobError | None = None,
        completion_tokens: int = 0,
        first_token_ms: int = 0,
    ) -> bool:
        """Store the final result once. Returns False when the job already had a terminal status
        (canceled meanwhile, or finished by another delivery): the caller must not publish twice."""
        assert status.is_terminal, status
        fields: list[str | int | bytes] = ["finished_ms", now_ms(), "completion_tokens", completion_tokens]
        if first_token_ms:
            fields += ["first_token_ms", first_token_ms]
        if output is not None:
            fields += ["output", encode_output(output)]
        if error is not None:
            fields += ["error_code", error.code, "error_message", error.message]
        stored = await self._finish(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.WEBHOOKS],
            args=[self._ttl_s, status.value, EVENTS_CAP, *fields],
        )
        return bool(stored)

    async def publish_tokens(self, deltas: list[TokenDelta]) -> None:
        """Append each delta as a `token` event to its job's stream, all in one round trip. A job's
        first events (offset 0) also set the stream's TTL, so a job that never finishes leaves no
        stream behind."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for delta in deltas:
                stream = keys.job_events(delta.job_id)
                event = {
                    "type": "token",
                    "text": delta.text,
                    "token_ids": json.dumps([delta.token_id]),
                    "offset": delta.offset,
                }
                pipe.xadd(stream, event, maxlen=EVENTS_CAP, approximate=True)
                if delta.offset == 0:
                    pipe.expire(stream, self._ttl_s)
            await pipe.execute()

    async def release(self, job_id: str, worker_id: str) -> bool:
        """Hand a running job back to the queue without counting its delivery (a graceful drain).
        False when it is no longer this worker's running job."""
        return bool(await self._release(keys=[keys.job(job_id)], args=[worker_id]))

    async def cancel(self, job_id: str) -> JobStatus | None:
        """Cancel a queued or running job. Returns the status after the call (None: no such job)."""
        result = await self._cancel(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.WEBHOOKS], args=[self._ttl_s, now_ms(), EVENTS_CAP]
        )
        return None if result is None else decode_status(result.decode(errors="replace"))


def _raise_if_unreadable(job_id: str, exc: ResponseError) -> None:
    """Raise SchemaError when a command failed because the job's record is not one (another Redis
    type, a field that is no integer); other server errors are the caller's to re-raise."""
    message = str(exc)
    if "WRONGTYPE" in message or "not an integer" in message:
        raise SchemaError(f"job {job_id}: the record cannot be read ({message[:120]})") from exc
