"""Jobs in: reads the resident models' streams for as many jobs as there is room for, takes over
entries whose worker died, and starts each job in the job store and the engine thread.

Each model has a stream per priority class: the interactive streams are read first, the batch
streams with what room is left, up to the batch jobs' share of it (worker/running_jobs.py), so a
worker full of batch work still reads interactive jobs and hands them to the engine.

Only resident models' streams are read: a job read for a model that is not resident could not run
soon, and would sit in this worker's pending list where no other worker takes it. An entry read
during a stop or a switch is put back for any worker. An entry that cannot be served is dead-lettered
with the reason, at its first delivery, and never stops the worker: no `job` field, a message that
does not decode (shared/schema.py names the field), a job record that cannot be read (another Redis
type, a status that is no JobStatus, attempts that are no count); so is one delivered too often.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.config import WorkerConfig
from shared.errors import ErrorCode
from shared.jobstore import JobStore
from shared.schema import PRIORITIES, JobError, JobMessage, JobStatus, Priority, SchemaError, decode_job
from worker.engine.engine import EngineRequest
from worker.engine_thread import EngineThread
from worker.job_stream import ack, autoclaim_page, dead_letter, ensure_group, requeue
from worker.running_jobs import RunningJob, RunningJobs
from worker.switching.switcher import ModelSwitcher

log = structlog.get_logger(__name__)

_READ_BLOCK_MS = 1000


class Intake:
    def __init__(
        self,
        redis: Redis,
        jobs: JobStore,
        config: WorkerConfig,
        running: RunningJobs,
        engine_thread: EngineThread,
        switcher: ModelSwitcher,
        stopping: asyncio.Event,
    ) -> None:
        self._redis = redis
        self._jobs = jobs
        self._config = config
        self._running = running
        self._engine_thread = engine_thread
        self._switcher = switcher
        self._stopping = stopping
        self._last_claim = 0.0

    async def consume_once(self) -> None:
        """Wait for room, or read (and first claim abandoned entries, every claim_idle_ms / 2) once."""
        room = self._running.room_left
        if room <= 0:
            self._running.room.clear()
            await self._running.room.wait()
            return
        readable = self._switcher.readable()
        if not readable:
            await asyncio.sleep(_READ_BLOCK_MS / 1000 / 10)  # mid-switch
            return
        if time.monotonic() - self._last_claim > self._config.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            for model in readable:
                for priority in PRIORITIES:
                    await self._claim_abandoned(model, priority, self._room(priority))
            if self._running.room_left <= 0:
                return
        read = await self._read(readable, Priority.INTERACTIVE, block_ms=None)
        if self._running.batch_room_left > 0:
            read += await self._read(readable, Priority.BATCH, block_ms=None)
        if not read:  # both empty: wait for the first entry of either class
            with_batch = PRIORITIES if self._running.batch_room_left > 0 else (Priority.INTERACTIVE,)
            await self._read(readable, *with_batch, block_ms=_READ_BLOCK_MS, count=1)

    def _room(self, priority: Priority) -> int:
        return self._running.room_left if priority is Priority.INTERACTIVE else self._running.batch_room_left

    async def _read(
        self, readable: list[str], *priorities: Priority, block_ms: int | None, count: int | None = None
    ) -> int:
        """Read and accept new entries of `readable` models' streams of `priorities` (at most the room
        of the first class each); returns how many were read."""
        queues = {keys.queue(model, priority): (model, priority) for priority in priorities for model in readable}
        try:
            response = await self._redis.xreadgroup(
                keys.WORKER_GROUP,
                self._config.worker_id,
                dict.fromkeys(queues, ">"),
                count=count or self._room(priorities[0]),
                block=block_ms,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.error("consumer_group_missing", error=str(exc))  # Redis came back without its data
            for spec in self._config.models:
                await ensure_group(self._redis, spec.name)
            return 0
        read = 0
        for stream, entries in response or []:
            model, priority = queues[stream.decode()]
            for entry_id, fields in entries:
                read += 1
                if self._stopping.is_set() or not self._switcher.admitting(model):
                    await requeue(self._redis, model, priority, entry_id, fields)  # read during a stop or switch
                else:
                    await self._accept(model, priority, entry_id, fields)
        return read

    async def _claim_abandoned(self, model: str, priority: Priority, count: int) -> None:
        """Take over entries whose worker stopped renewing them (it died), scanning the whole pending list."""
        cursor: bytes | str = "0-0"
        claimed = 0
        while claimed < count:
            cursor, entries = await autoclaim_page(
                self._redis, model, priority, self._config.worker_id, self._config.claim_idle_ms, start_id=cursor,
                count=count - claimed,
            )  # fmt: skip
            for entry_id, fields in entries:
                log.warning("job_reclaimed", model=model, priority=priority.value, entry=entry_id.decode())
                await self._accept(model, priority, entry_id, fields)
            claimed += len(entries)
            if cursor in (b"0-0", "0-0"):
                return

    async def _accept(self, model: str, priority: Priority, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = _decode_entry(fields)
        except SchemaError as exc:
            log.error("undecodable_job", model=model, entry=entry_id.decode(), error=str(exc))
            await dead_letter(self._redis, model, priority, entry_id, fields, reason=str(exc))
            return
        if message.job_id in self._running:
            return  # our own entry, already running
        try:
            status, attempts = await self._jobs.start(message.job_id, self._config.worker_id)
        except SchemaError as exc:
            log.error("unreadable_job_record", job=message.job_id, model=model, error=str(exc))
            await dead_letter(self._redis, model, priority, entry_id, fields, reason=str(exc))
            return
        if status is not JobStatus.RUNNING:
            await ack(self._redis, model, priority, entry_id)  # canceled while queued, finished earlier, or expired
            return
        if attempts > self._config.max_deliveries:
            await self._give_up(model, priority, entry_id, fields, message, attempts)
            return
        if not self._switcher.admitting(model):  # a switch began while the job was being started
            await self._jobs.release(message.job_id, self._config.worker_id)
            await requeue(self._redis, model, priority, entry_id, fields)
            return
        self._running.add(message.job_id, RunningJob(model, priority, entry_id, message.request_id, fields))
        log.info(
            "job_started",
            job=message.job_id,
            model=model,
            tenant=message.tenant,
            attempt=attempts,
            request_id=message.request_id,
        )
        self._engine_thread.submit(
            model,
            EngineRequest(
                job_id=message.job_id,
                prompt_token_ids=message.prompt_token_ids,
                sampling=message.sampling,
                tenant=message.tenant,
                adapter=message.adapter,
                deadline=message.deadline,
                stream=message.stream,
                priority=priority,
            ),
        )

    async def _give_up(
        self,
        model: str,
        priority: Priority,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        message: JobMessage,
        attempts: int,
    ) -> None:
        log.error("job_dead_lettered", job=message.job_id, attempts=attempts, request_id=message.request_id)
        error = JobError(ErrorCode.WORKER_CRASHED, f"the job was delivered {attempts - 1} times without finishing")
        await self._jobs.finish(message.job_id, JobStatus.FAILED, error=error)
        await dead_letter(self._redis, model, priority, entry_id, fields, reason="too many deliveries")


def _decode_entry(fields: dict[bytes, bytes]) -> JobMessage:
    """The job message a stream entry carries; SchemaError when it carries none or it does not decode."""
    payload = fields.get(b"job")
    if payload is None:
        raise SchemaError(f"the stream entry has no job field (fields: {sorted(fields)!r:.80})")
    return decode_job(payload)
