"""Moves batches along, in every gateway: each `driver_interval_s` a gateway leases each active batch
in turn (`lf:batch-lease:{id}`, SET NX with a TTL, so one gateway at a time drives a batch and a dead
gateway's batches pass to the others once its lease expires) and runs one step of it:

- validating: the input file is there → in_progress (its line count is the total); else failed.
- in_progress: finished lines' jobs are collected into the output or error lines; then input lines
  are queued from the cursor while fewer than `lines_in_flight` are in flight, each as an ordinary
  job of the batch class (same queue, adapters and isolation as any job), with an idempotency key
  of the batch and line, so a step cut short and run again queues no line twice. A line that is
  refused fails alone: its error line is written and the cursor moves on. Past the completion
  window the lines in flight are cancelled and every line not done is an error line (expired).
- cancelling: the lines in flight are cancelled; lines that finished anyway are kept; then cancelled.
- finalizing (on the way to completed, expired or cancelled): the output and error lines become files.

Each line lands in the output or error lines exactly once: a collected job leaves
`lf:batch-jobs:{id}` in the same script that appends its line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.batch_lines import custom_id, error_line, line_job_request, output_line, parse_line
from gateway.batches import BatchRecord, BatchStatus, BatchStore
from gateway.errors import RequestError
from gateway.files import FilePurpose, FileRecord, FileStore, new_file_id
from gateway.job_service import JobService
from shared import keys
from shared.config import BatchConfig, RequestLimits
from shared.errors import ErrorCode
from shared.jobstore import JobStore
from shared.schema import JobStatus
from shared.tenants import get_tenant

log = structlog.get_logger(__name__)

# KEYS: batch jobs, output or error list, batch hash   ARGV: job id, line, counter field
_COLLECT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
end
return 1
"""

# KEYS: batch hash, batch jobs, error list   ARGV: the line's index, job id (or ''), its in-flight value or error line
# The cursor moves only from the index the driver read: a driver whose lease ran out mid-step (a
# slow gateway) and that queues a line another driver has already recorded changes nothing.
_RECORD_LINE = """
if tonumber(redis.call('HGET', KEYS[1], 'cursor')) ~= tonumber(ARGV[1]) then return 0 end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
else
  redis.call('RPUSH', KEYS[3], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
end
redis.call('HSET', KEYS[1], 'cursor', ARGV[1] + 1)
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BatchDriver:
    def __init__(
        self,
        redis: Redis,
        batches: BatchStore,
        files: FileStore,
        jobs: JobService,
        store: JobStore,
        config: BatchConfig,
        limits: RequestLimits,
    ) -> None:
        self._redis = redis
        self._batches = batches
        self._files = files
        self._jobs = jobs
        self._store = store
        self._config = config
        self._limits = limits
        self._owner = uuid.uuid4().hex  # this gateway process, as a lease holder
        self._lease_ms = max(10_000, int(config.driver_interval_s * 20_000))
        self._collect = redis.register_script(_COLLECT)
        self._release = redis.register_script(_RELEASE)
        self._record_line = redis.register_script(_RECORD_LINE)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """End `run` after its current round: a step is never cut off midway (its lease would linger)."""
        self._stopping.set()

    async def run(self) -> None:
        """Drive every active batch each interval, and remove expired files and batches each janitor interval."""
        swept = 0.0
        while not self._stopping.is_set():
            try:
                if time.monotonic() - swept >= self._config.janitor_interval_s:
                    swept = time.monotonic()
                    await self._files.remove_expired()
                    await self._batches.remove_expired()
                await self.drive_all()
            except Exception:  # Redis away, a batch record that cannot be read: the next round tries again
                log.exception("batch_driver_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._config.driver_interval_s)

    async def drive_all(self) -> None:
        for batch_id in [b.decode() for b in await self._redis.smembers(keys.BATCHES_ACTIVE)]:
            lease = keys.batch_lease(batch_id)
            if not await self._redis.set(lease, self._owner, nx=True, px=self._lease_ms):
                continue  # another gateway drives it now
            try:
                await self.step(batch_id)
            finally:
                await self._release(keys=[lease], args=[self._owner])

    async def step(self, batch_id: str) -> None:
        """One step of one batch (the caller holds its lease)."""
        record = await self._batches.load(batch_id)
        if record is None or record.status.is_terminal:
            await self._redis.srem(keys.BATCHES_ACTIVE, batch_id)
            return
        if record.status is BatchStatus.VALIDATING:
            await self._validate(record)
        elif record.status is BatchStatus.IN_PROGRESS:
            if time.time() * 1000 >= record.expires_ms:
                await self._expire(record)
            else:
                await self._advance(record)
        elif record.status is BatchStatus.CANCELLING:
            await self._cancel_in_flight(record)
            if await self._collect_finished(record, canceled=None) == 0:
                await self._finalize(record, BatchStatus.CANCELLED)
        elif record.status is BatchStatus.FINALIZING:
            await self._finalize(record, record.final_status or BatchStatus.COMPLETED)

    async def _validate(self, record: BatchRecord) -> None:
        input_file = await self._redis.hget(keys.file(record.input_file_id), "lines")
        if input_file is None:
            error = {"code": ErrorCode.FILE_NOT_FOUND.value, "message": "the input file was deleted", "line": None}
            record.errors = [error]
            await self._batches.set_status(record, BatchStatus.FAILED, "errors", json.dumps(record.errors))
            return
        record.total = int(input_file)
        await self._batches.set_status(record, BatchStatus.IN_PROGRESS, "total", record.total)

    async def _advance(self, record: BatchRecord) -> None:
        in_flight = await self._collect_finished(record, canceled=ErrorCode.BATCH_CANCELLED)
        room = self._config.lines_in_flight - in_flight
        if room > 0 and record.cursor < record.total:
            await self._queue_lines(record, room)
        elif in_flight == 0 and record.cursor >= record.total:
            await self._finalize(record, BatchStatus.COMPLETED)

    async def _queue_lines(self, record: BatchRecord, room: int) -> None:
        tenant = await get_tenant(self._redis, record.tenant)
        deadline_s = max(1.0, record.expires_ms / 1000 - time.time())
        lines = await self._files.lines(record.input_file_id, record.cursor, room)
        for index, line in enumerate(lines, record.cursor):
            custom, job_id = custom_id(line), ""
            try:
                if tenant is None or tenant.disabled:
                    raise RequestError(ErrorCode.TENANT_DISABLED, "the batch's tenant is disabled")
                parsed = parse_line(line, record.endpoint, self._limits)
                request = await line_job_request(self._jobs, tenant, parsed, record.endpoint, deadline_s)
                job, _ = await self._jobs.submit(
                    tenant,
                    request,
                    request_id=_line_id(record, index),
                    idempotency_key=f"batch:{record.batch_id}:{index}",
                    admit=False,
                )
            except RequestError as refused:
                if refused.code is ErrorCode.MODEL_UNAVAILABLE:
                    return  # no worker serves the model now: the line waits for one, it does not fail
                line_out = error_line(
                    _line_id(record, index), custom, refused.code, refused.message, param=refused.param
                )
            except RedisError:
                raise  # Redis away: the step ends here, the next one goes on from the cursor
            except Exception:  # a line no check foresaw must not stall its batch: it fails alone, logged
                log.exception("batch_line_failed", batch=record.batch_id, line=index)
                line_out = error_line(_line_id(record, index), custom, ErrorCode.INTERNAL_ERROR.value, "internal error")
            else:  # in flight, with what its output line needs: collecting reads no input file
                job_id, line_out = job.job_id, json.dumps([index, custom, parsed.model])
            batch_keys = [
                keys.batch(record.batch_id),
                keys.batch_jobs(record.batch_id),
                keys.batch_errors(record.batch_id),
            ]
            if not await self._record_line(keys=batch_keys, args=[index, job_id, line_out]):
                return  # another driver has moved this batch on meanwhile

    async def _collect_finished(self, record: BatchRecord, *, canceled: ErrorCode | None) -> int:
        """Write the lines of finished jobs; returns how many are still in flight. A canceled job's line
        is an error line with code `canceled`, or, None, no line at all (the batch's own cancel)."""
        in_flight = [
            (job_id.decode(), *json.loads(value))
            for job_id, value in (await self._redis.hgetall(keys.batch_jobs(record.batch_id))).items()
        ]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id, *_ in in_flight:
                pipe.hget(keys.job(job_id), "status")
            statuses = await pipe.execute()
        finished = [entry for entry, status in zip(in_flight, statuses, strict=True)
                    if status not in (b"queued", b"running")]  # fmt: skip
        for job_id, index, custom, model in finished:
            job = await self._store.get(job_id)
            line_id = _line_id(record, index)
            if job is None:  # its record expired: nothing to report but the loss
                text, ok = error_line(line_id, custom, ErrorCode.JOB_NOT_FOUND.value, "the line's job expired"), False
            elif job.status is JobStatus.CANCELED:
                message = "the line's job was canceled before it finished"
                text, ok = ("" if canceled is None else error_line(line_id, custom, canceled.value, message)), False
            else:
                text, ok = output_line(line_id, custom, job, model, record.endpoint)
            await self._collect(
                keys=[
                    keys.batch_jobs(record.batch_id),
                    keys.batch_output(record.batch_id) if ok else keys.batch_errors(record.batch_id),
                    keys.batch(record.batch_id),
                ],
                args=[job_id, text, "completed" if ok else "failed"],
            )
        return len(in_flight) - len(finished)

    async def _cancel_in_flight(self, record: BatchRecord) -> None:
        for job_id in await self._redis.hkeys(keys.batch_jobs(record.batch_id)):
            await self._store.cancel(job_id.decode())

    async def _expire(self, record: BatchRecord) -> None:
        """Past the window: cancel the lines in flight, report them and every line never queued as expired."""
        await self._cancel_in_flight(record)
        await self._collect_finished(record, canceled=ErrorCode.BATCH_EXPIRED)
        lines = await self._files.lines(record.input_file_id, record.cursor, record.total - record.cursor)
        expired = [
            error_line(_line_id(record, index), custom_id(line), ErrorCode.BATCH_EXPIRED.value,
                       "the line did not run within the batch's completion window")
            for index, line in enumerate(lines, record.cursor)
        ]  # fmt: skip
        async with self._redis.pipeline(transaction=True) as pipe:
            if expired:
                pipe.rpush(keys.batch_errors(record.batch_id), *expired)
                pipe.hincrby(keys.batch(record.batch_id), "failed", len(expired))
            pipe.hset(keys.batch(record.batch_id), "cursor", record.total)
            await pipe.execute()
        await self._finalize(record, BatchStatus.EXPIRED)

    async def _finalize(self, record: BatchRecord, final: BatchStatus) -> None:
        """Through finalizing: the output and error lines become the batch's files, then `final`."""
        finalizing = record.status is BatchStatus.FINALIZING or await self._batches.set_status(
            record, BatchStatus.FINALIZING, "final_status", final.value
        )
        if not finalizing:
            return  # cancelled meanwhile: the next step sees it
        fields: list[str | int] = []
        for list_key, field in (
            (keys.batch_output(record.batch_id), "output_file_id"),
            (keys.batch_errors(record.batch_id), "error_file_id"),
        ):
            file_id = await self._lines_to_file(record, list_key, field)
            if file_id is not None:
                fields += [field, file_id]
        counts = await self._redis.hmget(keys.batch(record.batch_id), "completed", "failed")
        record.completed, record.failed = (int(c or 0) for c in counts)
        await self._batches.set_status(record, final, *fields)
        log.info("batch_finished", batch=record.batch_id, status=final.value, completed=record.completed,
                 failed=record.failed)  # fmt: skip

    async def _lines_to_file(self, record: BatchRecord, list_key: str, field: str) -> str | None:
        """The file made of the lines at `list_key` (moved, not copied), its id stored in the batch's `field`."""
        existing = await self._redis.hget(keys.batch(record.batch_id), field)
        if existing is not None:
            return existing.decode()
        count = await self._redis.llen(list_key)
        if count == 0:
            return None
        lines = await self._redis.lrange(list_key, 0, -1)
        now = int(time.time() * 1000)
        file = FileRecord(
            file_id=new_file_id(),
            tenant=record.tenant,
            filename=f"{record.batch_id}_{'output' if field == 'output_file_id' else 'error'}.jsonl",
            purpose=FilePurpose.BATCH_OUTPUT,
            num_bytes=sum(len(line) + 1 for line in lines),
            num_lines=count,
            created_ms=now,
            expires_ms=now + self._config.file_ttl_s * 1000,
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rename(list_key, keys.file_lines(file.file_id))
            self._files.add_record(pipe, file)
            pipe.hset(keys.batch(record.batch_id), field, file.file_id)
            await pipe.execute()
        return file.file_id


def _line_id(record: BatchRecord, index: int) -> str:
    return f"batch_req_{record.batch_id.removeprefix('batch_')}_{index}"
