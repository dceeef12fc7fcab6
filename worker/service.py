"""The worker process: Redis streams in, engine steps in a thread, results back to Redis.

Delivery is at-least-once: a stream entry is acknowledged only after its job's final state is
stored. While a job runs, this worker keeps re-claiming its entry so its idle time stays low; an
entry whose worker died goes idle and another worker claims it (XAUTOCLAIM) and runs it again.
The job store's Lua scripts make sure only one result is ever stored.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from shared import keys
from shared.chat_template import read_chat_template
from shared.config import WorkerConfig
from shared.errors import ErrorCode
from shared.jobstore import JobStore, now_ms
from shared.model_registry import publish_model
from shared.schema import JobError, JobMessage, JobStatus, SchemaError, TokenDelta, decode_job
from worker.engine.engine import EngineRequest, EngineResult, LLMEngine
from worker.engine_thread import EngineThread

log = structlog.get_logger(__name__)

_READ_BLOCK_MS = 1000
_CANCEL_POLL_S = 0.25
_DEAD_LETTER_MAXLEN = 10_000


@dataclass(slots=True)
class _InFlight:
    model: str
    entry_id: bytes
    request_id: str


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id = config.worker_id
        self.capacity = config.engine.max_num_seqs * 2  # a queue beyond the batch, so admission never idles
        self._redis = aioredis.Redis.from_url(config.redis_url)
        self._jobs = JobStore(self._redis, config.job_ttl_s)
        self._in_flight: dict[str, _InFlight] = {}
        self._room = asyncio.Event()
        # results and token deltas share one queue so a job's token events precede its end event
        self._results: asyncio.Queue[EngineResult | list[TokenDelta]] = asyncio.Queue()
        self._stopping = asyncio.Event()
        self._crash: BaseException | None = None
        self._engine_thread: EngineThread | None = None

    async def run(self) -> int:
        """Serve until `stop()`; returns the process exit code."""
        engines = await asyncio.to_thread(self._load_engines)
        loop = asyncio.get_running_loop()
        self._engine_thread = EngineThread(
            engines,
            on_result=lambda result: loop.call_soon_threadsafe(self._results.put_nowait, result),
            on_crash=lambda exc: loop.call_soon_threadsafe(self._engine_crashed, exc),
            on_deltas=lambda deltas: loop.call_soon_threadsafe(self._results.put_nowait, deltas),
        )
        self._engine_thread.start()
        for name, engine in engines.items():
            tokenizer_json = (self._model_path(name) / "tokenizer.json").read_bytes()
            await publish_model(self._redis, engine.info, tokenizer_json, read_chat_template(self._model_path(name)))
            await self._ensure_group(name)
        log.info("worker_ready", worker=self.id, models=list(engines))
        tasks = [
            asyncio.create_task(self._consume(), name="consume"),
            asyncio.create_task(self._publish(), name="publish"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._watch_cancels(), name="cancels"),
        ]
        await self._stopping.wait()
        await self._drain()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._engine_thread.stop()
        await self._redis.delete(keys.worker(self.id))
        await self._redis.srem(keys.WORKERS, self.id)
        await self._redis.aclose()
        log.info("worker_stopped", worker=self.id)
        return 1 if self._crash is not None else 0

    def stop(self) -> None:
        self._stopping.set()

    # -- start-up -------------------------------------------------------------------------------

    def _model_path(self, name: str):
        return next(spec.path for spec in self.config.models if spec.name == name)

    def _load_engines(self) -> dict[str, LLMEngine]:
        share = 1.0 / len(self.config.models)  # each served model gets an equal part of the KV memory
        return {
            spec.name: LLMEngine.from_spec(spec, self.config.engine, self.config.adapter_root, kv_memory_share=share)
            for spec in self.config.models
        }

    async def _ensure_group(self, model: str) -> None:
        try:
            await self._redis.xgroup_create(keys.queue(model), keys.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _engine_crashed(self, exc: BaseException) -> None:
        self._crash = exc
        self.stop()

    # -- intake ---------------------------------------------------------------------------------

    async def _consume(self) -> None:
        streams = {keys.queue(spec.name): ">" for spec in self.config.models}
        last_claim = 0.0
        while not self._stopping.is_set():
            room = self.capacity - len(self._in_flight)
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            if time.monotonic() - last_claim > self.config.claim_idle_ms / 2000:
                last_claim = time.monotonic()
                for spec in self.config.models:
                    await self._claim_abandoned(spec.name, room)
            response = await self._redis.xreadgroup(
                keys.WORKER_GROUP, self.id, streams, count=room, block=_READ_BLOCK_MS
            )
            for stream, entries in response or []:
                model = stream.decode().removeprefix(keys.queue(""))
                for entry_id, fields in entries:
                    await self._accept(model, entry_id, fields)

    async def _claim_abandoned(self, model: str, count: int) -> None:
        """Take over entries whose worker stopped renewing them (it died)."""
        _, entries, _ = await self._redis.xautoclaim(
            keys.queue(model), keys.WORKER_GROUP, self.id, min_idle_time=self.config.claim_idle_ms, count=count
        )
        for entry_id, fields in entries:
            log.warning("job_reclaimed", model=model, entry=entry_id.decode())
            await self._accept(model, entry_id, fields)

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
        self._in_flight[message.job_id] = _InFlight(model, entry_id, message.request_id)
        log.info("job_started", job=message.job_id, model=model, tenant=message.tenant, request_id=message.request_id)
        self._engine_thread.submit(
            model,
            EngineRequest(
                job_id=message.job_id,
                prompt_token_ids=message.prompt_token_ids,
                sampling=message.sampling,
                tenant=message.tenant,
                adapter=message.adapter,
                deadline=message.deadline,
            ),
        )

    async def _give_up(
        self, model: str, entry_id: bytes, fields: dict[bytes, bytes], message: JobMessage, attempts: int
    ) -> None:
        log.error("job_dead_lettered", job=message.job_id, attempts=attempts)
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

    async def _ack(self, model: str, entry_id: bytes) -> None:
        """Acknowledge and delete: a finished job's entry has no further use, so the stream stays short."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(keys.queue(model), keys.WORKER_GROUP, entry_id)
            pipe.xdel(keys.queue(model), entry_id)
            await pipe.execute()

    # -- results --------------------------------------------------------------------------------

    async def _publish(self) -> None:
        while True:
            result = await self._results.get()
            if isinstance(result, list):
                deltas = [delta for delta in result if delta.job_id in self._in_flight]
                if deltas:
                    await self._jobs.publish_tokens(deltas)
                continue
            flight = self._in_flight.pop(result.job_id, None)
            if flight is None:
                continue  # canceled meanwhile: already acknowledged
            stored = await self._jobs.finish(
                result.job_id,
                result.status,
                output=result.output,
                error=result.error,
                completion_tokens=result.completion_tokens,
                first_token_ms=result.first_token_ms,
            )
            await self._ack(flight.model, flight.entry_id)
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
        """Stop running jobs that were canceled, or whose record vanished (expired TTL)."""
        while True:
            await asyncio.sleep(_CANCEL_POLL_S)
            job_ids = list(self._in_flight)
            if not job_ids:
                continue
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.hget(keys.job(job_id), "status")
                statuses = await pipe.execute()
            for job_id, status in zip(job_ids, statuses, strict=True):
                flight = self._in_flight.get(job_id)
                if flight is None or status not in (b"canceled", None):
                    continue
                self._engine_thread.abort(job_id)
                del self._in_flight[job_id]
                await self._ack(flight.model, flight.entry_id)
                self._room.set()
                log.info("job_aborted", job=job_id, status=(status or b"missing").decode())

    async def _heartbeat(self) -> None:
        """Advertise this worker, and renew the claim on every running entry so no live job is stolen."""
        ttl_s = max(3, int(self.config.heartbeat_interval_s * 3))
        while True:
            by_model: dict[str, list[bytes]] = {}
            for flight in self._in_flight.values():
                by_model.setdefault(flight.model, []).append(flight.entry_id)
            for model, entry_ids in by_model.items():
                await self._redis.xclaim(
                    keys.queue(model), keys.WORKER_GROUP, self.id, min_idle_time=0, message_ids=entry_ids, justid=True
                )
            await self._redis.hset(
                keys.worker(self.id),
                mapping={
                    "models": json.dumps([spec.name for spec in self.config.models]),
                    "device": self.config.engine.device,
                    "in_flight": len(self._in_flight),
                    "capacity": self.capacity,
                    "updated_ms": now_ms(),
                },
            )
            await self._redis.expire(keys.worker(self.id), ttl_s)
            await self._redis.sadd(keys.WORKERS, self.id)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _drain(self, grace_s: float = 30.0) -> None:
        """Stop taking jobs and give running ones `grace_s` to finish; the rest stay pending in the
        stream for another worker to claim."""
        deadline = time.monotonic() + grace_s
        while self._in_flight and self._crash is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._in_flight:
            log.warning("drain_incomplete", left=len(self._in_flight))
