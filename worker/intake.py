"""Jobs in: reads the resident models' streams (each model's shared streams and this worker's own
stream of interactive jobs routed to it, worker/routed_streams.py) for as many jobs as there is room
for, takes over entries whose worker died, steals entries that waited too long on a busy worker's
stream while this one has free batch slots, and starts each job in the job store and the engine thread.

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
from enum import StrEnum

import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.config import WorkerConfig
from shared.errors import ErrorCode
from shared.jobstore import JobStore
from shared.schema import PRIORITIES, JobError, JobMessage, JobStatus, Priority, SchemaError, decode_job
from worker.engine.engine_request import EngineRequest
from worker.engine_thread import EngineThread
from worker.job_stream import ack, autoclaim_page, dead_letter, ensure_group, requeue, shared_streams
from worker.metrics import AdapterTier, WorkerMetrics
from worker.routed_streams import Entries, RoutedStreams
from worker.running_jobs import JobTimes, RunningJob, RunningJobs
from worker.switching.switcher import ModelSwitcher

log = structlog.get_logger(__name__)

_READ_BLOCK_MS = 1000


class Arrival(StrEnum):
    """How a job reached this worker (metrics: routed vs stolen)."""

    ROUTED = "routed"  # placed on this worker's own stream by the gateway
    SHARED = "shared"  # read from the model's shared stream (base-model jobs, jobs handed back)
    STOLEN = "stolen"  # waited past the bound on another worker's stream (worker/routed_streams.py)
    RECLAIMED = "reclaimed"  # its worker died while running it


# what a stream read holds: its model, its priority class, and how its jobs reach this worker
StreamOrigin = tuple[str, Priority, Arrival]


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
        metrics: WorkerMetrics,
    ) -> None:
        self._redis = redis
        self._jobs = jobs
        self._config = config
        self._running = running
        self._engine_thread = engine_thread
        self._switcher = switcher
        self._stopping = stopping
        self._metrics = metrics
        self._streams = RoutedStreams(redis, config.worker_id)
        self._last_claim = 0.0
        self._last_steal = 0.0
        # an idle read returns this often, so entries waiting on a busy worker are stolen near the bound
        self._read_block_ms = max(10, min(_READ_BLOCK_MS, config.steal_after_ms // 4))

    async def consume_once(self) -> None:
        """Wait for room, or read (and first claim abandoned entries, every claim_idle_ms / 2) once;
        with free batch slots left after that, steal what waited too long on other workers' streams."""
        if self._running.room_left <= 0:
            self._running.room.clear()
            await self._running.room.wait()
            return
        readable = self._switcher.readable()
        if not readable:
            await asyncio.sleep(_READ_BLOCK_MS / 1000 / 10)  # mid-switch
            return
        if time.monotonic() - self._last_claim > self._config.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            for spec in self._config.models:  # routed here in the moment before a heartbeat said it went
                if spec.name not in readable and not self._stopping.is_set():
                    await self._streams.hand_over_own(spec.name)
            for model in readable:
                await self._streams.adopt_orphans(model)
                for priority in PRIORITIES:
                    for stream in await self._streams.of_model(model, priority):
                        await self._claim_abandoned(model, priority, stream, self._room(priority))
            if self._running.room_left <= 0:
                return
        read = await self._read_oldest(readable, Priority.INTERACTIVE)
        if self._running.batch_room_left > 0:
            read += await self._read_oldest(readable, Priority.BATCH)
        if not read:  # all empty: wait for the first entry of any of them
            with_batch = PRIORITIES if self._running.batch_room_left > 0 else (Priority.INTERACTIVE,)
            await self._wait_and_read(readable, *with_batch)
        await self._steal_if_idle(readable)

    def _room(self, priority: Priority) -> int:
        return self._running.room_left if priority is Priority.INTERACTIVE else self._running.batch_room_left

    def _streams_of(self, model: str, priority: Priority) -> dict[str, Arrival]:
        """The streams this worker reads for `model`'s class `priority`: the shared one and, for interactive
        jobs (the class routing places), its own."""
        shared = {keys.queue(model, priority): Arrival.SHARED}
        return shared | {self._streams.own(model): Arrival.ROUTED} if priority is Priority.INTERACTIVE else shared

    def _readable_streams(self, readable: list[str], *priorities: Priority) -> dict[str, StreamOrigin]:
        """The streams of `readable` models' classes `priorities`: stream → (model, class, arrival)."""
        return {
            stream: (model, priority, arrival)
            for priority in priorities
            for model in readable
            for stream, arrival in self._streams_of(model, priority).items()
        }

    async def _read_oldest(self, readable: list[str], priority: Priority) -> int:
        """Read and accept the oldest new entries over `readable` models' streams of class `priority`, as
        many as the class has room for; returns how many were read."""
        room = self._room(priority)
        if room <= 0:
            return 0
        streams = self._readable_streams(readable, priority)
        return await self._accept_read(await self._streams.read_oldest(list(streams), room), streams)

    async def _wait_and_read(self, readable: list[str], *priorities: Priority) -> None:
        """Wait up to the read block for the first new entry of `readable` models' streams of `priorities`,
        and accept what comes: one entry a stream (the count holds for each), so no more than the rooms of
        their classes unless entries reach several streams within the same moment; the next turn's reads
        take the rest, oldest first."""
        streams = self._readable_streams(readable, *priorities)
        try:
            response = await self._redis.xreadgroup(
                keys.WORKER_GROUP,
                self._config.worker_id,
                dict.fromkeys(streams, ">"),
                count=1,
                block=self._read_block_ms,
            )
        except ResponseError as exc:
            if "UNBLOCKED" in str(exc):  # a stream read was deleted meanwhile (a routed stream handed over)
                return
            if "NOGROUP" not in str(exc):
                raise
            recreated = [
                stream
                for spec in self._config.models
                for stream in shared_streams(spec.name)
                if await ensure_group(self._redis, stream)
            ]
            for spec in self._config.models:
                await self._streams.register(spec.name)
            if recreated:  # shared streams are never deleted: Redis came back without its data
                log.error("consumer_group_missing", streams=recreated, error=str(exc))
            else:  # this worker's routed stream, handed over (at a switch, a stop, or by a worker that found its
                # heartbeat gone), came back without its group when the gateway routed a job here again
                log.info("routed_stream_regrouped", error=str(exc))
            return
        await self._accept_read([(key.decode(), entries) for key, entries in response or []], streams)

    async def _accept_read(self, read: list[tuple[str, Entries]], streams: dict[str, StreamOrigin]) -> int:
        """Accept entries just read, (stream, entries) pairs of `streams`; returns how many there were."""
        count, read_at = 0, time.time()
        for stream, entries in read:
            model, priority, arrival = streams[stream]
            for entry_id, fields in entries:
                count += 1
                if self._stopping.is_set() or not self._switcher.admitting(model):
                    # read during a stop or a switch
                    await requeue(self._redis, model, priority, stream, entry_id, fields)
                else:
                    await self._accept(model, priority, stream, entry_id, fields, arrival, read_at)
        return count

    async def _steal_if_idle(self, readable: list[str]) -> None:
        """With free batch slots (jobs would run now, not queue), take entries that have waited past
        `steal_after_ms` on other workers' streams; tried every quarter of the bound at most. Only
        interactive jobs are routed, so only they are stolen."""
        free = min(self._running.room_left, self._config.engine.max_num_seqs - len(self._running))
        if free <= 0 or self._stopping.is_set() or time.monotonic() - self._last_steal < self._read_block_ms / 1000:
            return
        self._last_steal = time.monotonic()
        for model in readable:
            if not self._switcher.admitting(model):
                continue
            stolen = await self._streams.steal(model, free, self._config.steal_after_ms)
            read_at = time.time()
            for stream, entries in stolen:
                for entry_id, fields in entries:
                    log.info("job_stolen", model=model, stream=stream, entry=entry_id.decode())
                    await self._accept(model, Priority.INTERACTIVE, stream, entry_id, fields, Arrival.STOLEN, read_at)
            free = min(self._running.room_left, self._config.engine.max_num_seqs - len(self._running))
            if free <= 0:
                return

    async def _claim_abandoned(self, model: str, priority: Priority, stream: str, count: int) -> None:
        """Take over entries of `stream` whose worker stopped renewing them (it died), scanning the whole
        pending list."""
        cursor: bytes | str = "0-0"
        claimed = 0
        while claimed < count:
            try:
                cursor, entries = await autoclaim_page(
                    self._redis, stream, self._config.worker_id, self._config.claim_idle_ms, start_id=cursor,
                    count=count - claimed,
                )  # fmt: skip
            except ResponseError as exc:  # a worker stream deleted since it was listed: nothing to claim
                if "NOGROUP" not in str(exc):
                    raise
                return
            read_at = time.time()
            for entry_id, fields in entries:
                log.warning("job_reclaimed", model=model, priority=priority, stream=stream, entry=entry_id.decode())
                await self._accept(model, priority, stream, entry_id, fields, Arrival.RECLAIMED, read_at)
            claimed += len(entries)
            if cursor in (b"0-0", "0-0"):
                return

    async def _accept(
        self, model: str, priority: Priority, stream: str, entry_id: bytes, fields: dict[bytes, bytes],
        arrival: Arrival, read_at: float,
    ) -> None:  # fmt: skip
        """Start the job of one entry read at `read_at` (unix s) and hand it to the engine thread."""
        try:
            message = _decode_entry(fields)
        except SchemaError as exc:
            log.error("undecodable_job", model=model, entry=entry_id.decode(), error=str(exc))
            await dead_letter(self._redis, model, stream, entry_id, fields, reason=str(exc))
            return
        if message.job_id in self._running:
            return  # our own entry, already running
        try:
            status, attempts = await self._jobs.start(message.job_id, self._config.worker_id)
        except SchemaError as exc:
            log.error("unreadable_job_record", job=message.job_id, model=model, error=str(exc))
            await dead_letter(self._redis, model, stream, entry_id, fields, reason=str(exc))
            return
        if status is not JobStatus.RUNNING:
            await ack(self._redis, stream, entry_id)  # canceled while queued, finished earlier, or expired
            return
        if attempts > self._config.max_deliveries:
            await self._give_up(model, stream, entry_id, fields, message, attempts)
            return
        if not self._switcher.admitting(model):  # a switch began while the job was being started
            await self._jobs.release(message.job_id, self._config.worker_id)
            await requeue(self._redis, model, priority, stream, entry_id, fields)
            return
        times = JobTimes(created=message.created_at, read=read_at, started=time.time())
        self._running.add(
            message.job_id, RunningJob(model, priority, stream, entry_id, message.request_id, fields, times=times)
        )
        self._metrics.job_started(model, arrival, self._adapter_tier(model, message))
        log.info(
            "job_started",
            job=message.job_id,
            model=model,
            tenant=message.tenant,
            attempt=attempts,
            arrival=arrival.value,
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

    def _adapter_tier(self, model: str, message: JobMessage) -> str:
        """Where the job's adapter is on this worker now (as of its engine's last step): the hit rate by tier."""
        if message.adapter is None:
            return "none"
        engine = self._switcher.residency.engines.get(model)
        pool = None if engine is None else engine.adapter_pool  # None: a worker without LoRA
        gpu, host = pool.resident if pool is not None else ((), ())
        uid = message.adapter.uid
        return AdapterTier.GPU if uid in gpu else AdapterTier.CPU if uid in host else AdapterTier.DISK

    async def _give_up(
        self, model: str, stream: str, entry_id: bytes, fields: dict[bytes, bytes], message: JobMessage, attempts: int
    ) -> None:
        log.error("job_dead_lettered", job=message.job_id, attempts=attempts, request_id=message.request_id)
        error = JobError(ErrorCode.WORKER_CRASHED, f"the job was delivered {attempts - 1} times without finishing")
        await self._jobs.finish(message.job_id, JobStatus.FAILED, error=error)
        await dead_letter(self._redis, model, stream, entry_id, fields, reason="too many deliveries")


def _decode_entry(fields: dict[bytes, bytes]) -> JobMessage:
    """The job message a stream entry carries; SchemaError when it carries none or it does not decode."""
    payload = fields.get(b"job")
    if payload is None:
        raise SchemaError(f"the stream entry has no job field (fields: {sorted(fields)!r:.80})")
    return decode_job(payload)
