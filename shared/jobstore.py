"""Job state in Redis: creation, the worker's start and finish, cancel, and long-poll waits.

Every status change is one Lua script (shared/job_scripts.py), so a cancel racing a finish, or a
job redelivered after a worker crash, can never overwrite a terminal state: the first terminal write
wins and the job has exactly one stored result. The same script that writes the terminal state
queues the job's webhook (if it has one) on `lf:webhooks`, so a webhook is queued exactly once,
whoever ends the job.

With replicas to wait for (`ReplicaWait`), a new job counts as created only once that many replicas
acknowledged it (WAIT): one that none confirms in time is withdrawn, every key its creation wrote
deleted in one script, and ReplicaUnavailable raised. So a job the gateway accepted survives the
loss of the primary (docs/reliability.md says what that costs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import structlog
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.config import ReplicaWait
from shared.job_events import EVENTS_CAP
from shared.job_scripts import TOKENS_LUA, register_job_scripts
from shared.jobstore_errors import ReplicaUnavailable, raise_if_unreadable, raise_on_error
from shared.rate_limits import AdmissionCheck, AdmissionDenied, denial
from shared.schema import (
    JobError,
    JobMessage,
    JobOutput,
    JobRecord,
    JobStatus,
    JobTrace,
    SchemaError,
    TokenDelta,
    decode_status,
    encode_job,
    encode_output,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Finish:
    """One job's end, as `JobStore.finish` takes it (see there)."""

    job_id: str
    status: JobStatus
    output: JobOutput | None = None
    error: JobError | None = None
    completion_tokens: int = 0
    first_token_ms: int = 0
    entry: tuple[str, bytes] | None = None
    trace: JobTrace | None = None


@dataclass(frozen=True, slots=True)
class StepStored:
    """What `publish_step` did: the token events' error (the others' events are written all the same), and
    per ending, in order, whether its result was stored (False: it was terminal already) or the SchemaError
    that its record or events stream cannot be written."""

    tokens_error: SchemaError | None
    stored: list[bool | SchemaError]


class BatchedClient(Protocol):
    """What `create` and `get` need of their client: a Redis client, or a gateway's auto-pipeline
    (gateway/auto_pipeline.py), which sends the commands of one event-loop turn together."""

    def hgetall(self, key: str) -> Awaitable[dict[bytes, bytes]]: ...

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]: ...

    async def script_load(self, script: str) -> str: ...

    def wait_replicas(self, replicas: int, timeout_ms: int) -> Awaitable[int]:
        """WAIT on the connection of the writes issued in the same event-loop turn."""
        ...


async def _load_and_run(client: BatchedClient, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
    """After NOSCRIPT (a restarted Redis): load the script, then send its EVALSHA again."""
    script.sha = await client.script_load(script.script)
    return await client.evalsha(script.sha, len(keys), *keys, *args)


_NO_REPLICA_WAIT = ReplicaWait()


def _forget(future: Awaitable[Any]) -> None:
    """Drop a batched reply no one will await (its error, if any, is retrieved so asyncio does not log it)."""
    if isinstance(future, asyncio.Future):
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()


def _raise_token_errors(reply: Any) -> None:
    """The tokens script's reply: the errors of the tokens it could not write (SchemaError when an
    events key is of another type), or the error of the whole call."""
    errors = [reply] if isinstance(reply, ResponseError) else [ResponseError(e.decode(errors="replace")) for e in reply]
    raise_on_error(errors, "a job's token events")


def now_ms() -> int:
    return int(time.time() * 1000)


class JobStore:
    """Owns the `lf:job:*` hashes and `lf:out:*` event streams; queues are written only through `create`."""

    def __init__(
        self,
        redis: Redis,
        job_ttl_s: int,
        *,
        batched: BatchedClient | None = None,
        replica_wait: ReplicaWait = _NO_REPLICA_WAIT,
    ) -> None:
        """`batched`: send `create` and `get` through this auto-pipeline (a gateway's many concurrent
        requests then share Redis round trips, and one WAIT confirms all of a batch's new jobs); otherwise
        every call is its own round trip. `replica_wait`: how new jobs and results are confirmed."""
        self._redis = redis
        self._batched: BatchedClient = batched or redis
        self._ttl_s = job_ttl_s
        self._replica_wait = replica_wait
        self._scripts = register_job_scripts(redis)

    async def create(
        self,
        record: JobRecord,
        message: JobMessage,
        idempotency_key: str | None = None,
        admission: AdmissionCheck | None = None,
        queue: str | None = None,
    ) -> tuple[str, bool]:
        """Write the job hash, then its queue entry, atomically (one script, one round trip); the entry goes
        on `queue`, a worker's routed stream (gateway/routing.py), or by default the model's shared stream of the
        job's class. Returns (job id, newly created); a repeated idempotency key returns the first job's id and queues
        nothing (nor is admitted again). With `admission`, the job is admitted first in the same script,
        and AdmissionDenied is raised, with nothing written, when it is not. With replicas to wait for,
        ReplicaUnavailable is raised, the job withdrawn, when too few confirm it in time."""
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
                queue is not None,
            ]
        )
        script_keys = [keys.job(record.job_id), queue or keys.queue(record.model, message.priority), idem_key]
        script_keys.append(keys.worker_queues(record.model))
        script_keys += admission.keys if admission else ()
        script_args = [encode_job(message), packed]
        if self._replica_wait.replicas and self._batched is self._redis:
            reply, confirmed = await self._run_and_wait(self._scripts.create, script_keys, script_args)
            reply = await self._withdraw_unconfirmed(record, script_keys, reply, confirmed)
        elif self._replica_wait.replicas:
            reply = await self._create_confirmed(record, script_keys, script_args)
        else:
            # EVALSHA awaited here, not through redis-py's Script call (an import and an isinstance check through
            # typing's Protocol machinery per call) nor a helper coroutine (one more frame to resume on the reply)
            try:
                reply = await self._batched.evalsha(
                    self._scripts.create.sha, len(script_keys), *script_keys, *script_args
                )
            except NoScriptError:
                reply = await _load_and_run(self._batched, self._scripts.create, script_keys, script_args)
        if reply[0] == 2:
            raise AdmissionDenied(denial(*reply[1:]))
        created, job_id = reply[0], reply[1]
        return job_id.decode() if isinstance(job_id, bytes) else job_id, bool(created)

    async def _create_confirmed(self, record: JobRecord, script_keys: list[str], script_args: list[Any]) -> Any:
        """The create script's reply, once `replica_wait.replicas` replicas have its writes; otherwise the
        job is withdrawn and ReplicaUnavailable raised."""
        wait = self._replica_wait
        reply_future = self._batched.evalsha(self._scripts.create.sha, len(script_keys), *script_keys, *script_args)
        confirmed_future = self._batched.wait_replicas(wait.replicas, wait.timeout_ms)  # same turn: same batch
        try:
            reply = await reply_future
        except NoScriptError:  # a restarted or promoted Redis: load the script, then create and wait again
            _forget(confirmed_future)
            self._scripts.create.sha = await self._batched.script_load(self._scripts.create.script)
            return await self._create_confirmed(record, script_keys, script_args)
        except BaseException:
            _forget(confirmed_future)
            raise
        try:
            confirmed = await confirmed_future
        except (RedisConnectionError, RedisTimeoutError) as exc:  # never retried: a new connection confirms nothing
            log.warning("replica_wait_failed", job=record.job_id, error=str(exc))
            confirmed = 0
        return await self._withdraw_unconfirmed(record, script_keys, reply, confirmed)

    async def _withdraw_unconfirmed(self, record: JobRecord, script_keys: list[str], reply: Any, confirmed: int) -> Any:
        """The create's reply if it created nothing or enough replicas confirmed it; else withdraw the job
        and raise ReplicaUnavailable."""
        wait = self._replica_wait
        if reply[0] != 1 or confirmed >= wait.replicas:
            return reply
        use_idem = script_keys[2] != keys.job(record.job_id)
        await self._scripts.withdraw(
            keys=[*script_keys[:3], keys.active_jobs(record.tenant), keys.job_events(record.job_id)],
            args=[record.job_id, reply[2], int(use_idem)],
        )
        raise ReplicaUnavailable(record.job_id, confirmed, wait)

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record, None when there is none; SchemaError when it cannot be read as one."""
        try:
            raw = await self._batched.hgetall(keys.job(job_id))
        except ResponseError as exc:
            raise_if_unreadable(f"job {job_id}'s record", exc)
            raise
        return JobRecord.from_hash(raw) if raw else None

    async def start(self, job_id: str, worker_id: str) -> tuple[JobStatus | None, int]:
        """Mark a job running on this worker; returns (status, attempts so far including this one).

        RUNNING: run it. A terminal status: skip it (canceled while queued, or already finished by
        an earlier delivery). None: the record has expired. SchemaError: the record cannot be read
        (not a hash, a status that is no JobStatus, attempts that are not a count).
        """
        try:
            status, attempts = await self._scripts.start(keys=[keys.job(job_id)], args=[worker_id, now_ms()])
        except ResponseError as exc:
            raise_if_unreadable(f"job {job_id}'s record", exc)
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
        entry: tuple[str, bytes] | None = None,
        trace: JobTrace | None = None,
    ) -> bool:
        """Store the final result once and, with `entry` (the key of the stream it was read from, entry id),
        acknowledge the job's queue entry in the same script. Returns False when the job already had a terminal status
        (canceled meanwhile, or finished by another delivery): the caller must not publish twice. With
        replicas to wait for, it returns once they have the result, or the wait timed out (logged: the
        result is stored, and if the primary is lost before a replica has it, the job runs again).
        `trace`: when the job passed each point of the worker, written into the record with the result.
        SchemaError: the record or its events stream cannot be written (a key of another type)."""
        return await self.store_finish(
            Finish(job_id, status, output, error, completion_tokens, first_token_ms, entry, trace)
        )

    async def store_finish(self, ending: Finish) -> bool:
        """`finish`, for one ending already gathered (the worker's results)."""
        job_id = ending.job_id
        script_keys, script_args = self._finish_call(ending)
        try:
            if not self._replica_wait.replicas:
                return bool(await self._scripts.finish(keys=script_keys, args=script_args))
            stored, confirmed = await self._run_and_wait(self._scripts.finish, script_keys, script_args)
        except ResponseError as exc:
            raise_if_unreadable(f"job {job_id}'s record or events", exc)
            raise
        if confirmed < self._replica_wait.replicas:
            log.warning("result_not_replicated", job=job_id, confirmed=confirmed, wanted=self._replica_wait.replicas)
        return bool(stored)

    @property
    def waits_for_replicas(self) -> bool:
        return bool(self._replica_wait.replicas)

    async def publish_step(self, deltas: list[TokenDelta], endings: list[Finish]) -> StepStored:
        """An engine step's token events (as `publish_tokens`), then its finished jobs' results (as `finish`,
        in order after the events), all in one round trip: a job's end costs no round trip of its own.
        Only without replicas to wait for: a result's WAIT would hold the next steps' events up behind it
        (`finish` each result then). Not to be repeated as a whole after a lost connection: its events
        may have been written (publish the parts again on their own)."""
        assert not self._replica_wait.replicas
        calls = [self._finish_call(ending) for ending in endings]
        async with self._redis.pipeline(transaction=False) as pipe:
            if deltas:
                pipe.eval(*self._tokens_call(deltas))
            for script_keys, script_args in calls:
                pipe.evalsha(self._scripts.finish.sha, len(script_keys), *script_keys, *script_args)
            replies = await pipe.execute(raise_on_error=False)
        tokens_error = None
        try:
            if deltas:
                _raise_token_errors(replies[0])
        except SchemaError as exc:
            tokens_error = exc
        finish_replies = replies[1:] if deltas else replies
        stored: list[bool | SchemaError] = []
        for ending, reply in zip(endings, finish_replies, strict=True):
            if isinstance(reply, NoScriptError):  # a restarted Redis: the script call loads it
                try:
                    reply = await self.store_finish(ending)
                except SchemaError as exc:
                    reply = exc
            elif isinstance(reply, ResponseError):
                try:
                    raise_if_unreadable(f"job {ending.job_id}'s record or events", reply)
                except SchemaError as exc:
                    reply = exc
                else:
                    raise reply
            stored.append(reply if isinstance(reply, SchemaError) else bool(reply))
        return StepStored(tokens_error, stored)

    def _finish_call(self, ending: Finish) -> tuple[list[Any], list[Any]]:
        """The finish script's keys and arguments for `ending`."""
        assert ending.status.is_terminal, ending.status
        fields: list[str | int | bytes] = ["finished_ms", now_ms(), "completion_tokens", ending.completion_tokens]
        if ending.first_token_ms:
            fields += ["first_token_ms", ending.first_token_ms]
        if ending.output is not None:
            fields += ["output", encode_output(ending.output)]
        if ending.error is not None:
            fields += ["error_code", ending.error.code, "error_message", ending.error.message]
        if ending.trace is not None:
            fields += ending.trace.hset_fields()
        script_keys: list[Any] = [keys.job(ending.job_id), keys.job_events(ending.job_id), keys.WEBHOOKS]
        script_args: list[Any] = [self._ttl_s, ending.status.value, EVENTS_CAP, b""]
        if ending.entry is not None:
            script_keys.append(ending.entry[0])
            script_args[3] = ending.entry[1]
        return script_keys, [*script_args, *fields]

    async def _run_and_wait(
        self, script: AsyncScript, script_keys: list[Any], script_args: list[Any]
    ) -> tuple[Any, int]:
        """Run `script`, then WAIT on the same connection (one round trip): (its reply, replicas that have
        its writes). A WAIT that fails counts as no replica."""
        wait = self._replica_wait
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.evalsha(script.sha, len(script_keys), *script_keys, *script_args)
            pipe.wait(wait.replicas, wait.timeout_ms)
            reply, confirmed = await pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError):  # a restarted or promoted Redis: load it, then run and wait again
            script.sha = await self._redis.script_load(script.script)
            return await self._run_and_wait(script, script_keys, script_args)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(confirmed, Exception):
            log.warning("replica_wait_failed", error=str(confirmed))
            confirmed = 0
        return reply, confirmed

    async def publish_tokens(self, deltas: list[TokenDelta]) -> None:
        """Append each delta as a `token` event to its job's stream, all in one script call. A job's
        first events (offset 0) also set the stream's TTL, so a job that never finishes leaves no
        stream behind. SchemaError when a job's events key is of another type (the others' events are
        written all the same)."""
        if deltas:
            _raise_token_errors(await self._redis.eval(*self._tokens_call(deltas)))

    def _tokens_call(self, deltas: list[TokenDelta]) -> tuple[Any, ...]:
        """EVAL's arguments for TOKENS_LUA over `deltas`: one command for a step's tokens, where an XADD
        each cost the worker's I/O thread several times the Python per step (docs/benchmarks.md, issue #20). The
        script goes as its text, not by SHA: it never meets NOSCRIPT (a restarted Redis), so a step's
        tokens are never written after the ends that follow them in `publish_step`'s round trip."""
        streams = [keys.job_events(delta.job_id) for delta in deltas]
        args: list[Any] = [self._ttl_s, EVENTS_CAP]
        for delta in deltas:
            args += (delta.text, delta.token_id, delta.offset)
        return (TOKENS_LUA, len(streams), *streams, *args)

    async def release(self, job_id: str, worker_id: str) -> bool:
        """Hand a running job back to the queue without counting its delivery (a graceful drain).
        False when it is no longer this worker's running job; SchemaError when the record cannot be read."""
        try:
            return bool(await self._scripts.release(keys=[keys.job(job_id)], args=[worker_id]))
        except ResponseError as exc:
            raise_if_unreadable(f"job {job_id}'s record", exc)
            raise

    async def cancel(self, job_id: str) -> JobStatus | None:
        """Cancel a queued or running job. Returns the status after the call (None: no such job)."""
        result = await self._scripts.cancel(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.WEBHOOKS], args=[self._ttl_s, now_ms(), EVENTS_CAP]
        )
        return None if result is None else decode_status(result.decode(errors="replace"))
