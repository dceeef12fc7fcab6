"""Jobs out: stores each finished job's result and acknowledges its entry, publishes token deltas for
streaming jobs, and stops running jobs that were canceled (or whose record expired).

Each step's deltas and results come from the engine thread as one item of one queue, so a job's token
events precede its end event; without replicas to wait for, a step's results are stored in the same
round trip as its deltas. A result and its entry's acknowledgement are one script (at-least-once
delivery: an entry is never acknowledged without its result), followed by a wait for the replicas when
the fleet has them; storing is safe to repeat, as the job store keeps the first result. A job whose record (or
events stream) became unwritable while it ran (a key of another type) has its entry dead-lettered
with the reason; the loops go on.
"""

from __future__ import annotations

import asyncio
import functools
import time

import structlog
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.jobstore import Finish, JobStore
from shared.schema import JobTrace, SchemaError, TokenDelta
from worker.engine.engine_request import EngineResult
from worker.engine_thread import EngineThread, StepOutput
from worker.job_stream import ack, dead_letter
from worker.metrics import WorkerMetrics
from worker.redis_retry import retrying
from worker.running_jobs import RunningJob, RunningJobs

log = structlog.get_logger(__name__)

CANCEL_POLL_S = 0.25


class ResultPublisher:
    def __init__(self, redis: Redis, jobs: JobStore, running: RunningJobs, metrics: WorkerMetrics) -> None:
        self._redis = redis
        self._jobs = jobs
        self._running = running
        self._metrics = metrics
        self.queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._storing: set[asyncio.Task[None]] = set()

    async def publish(self) -> None:
        """Forever: publish each step's token deltas, in the order the steps came, and store each result
        once the deltas before it are out. Without replicas to wait for, a step's results ride in the
        same round trip as its deltas. With them, results are stored concurrently: each waits for the
        replicas on its own connection, so a slow or missing replica delays that job's completion, not
        every job behind it."""
        while True:
            output = await self.queue.get()
            out_at = time.time()
            try:
                deltas = [delta for delta in output.deltas if delta.job_id in self._running]
                if output.results and not self._jobs.waits_for_replicas:
                    await self._publish_step(deltas, output.results, out_at)
                    continue
                if deltas:
                    await self._publish_tokens(deltas)
                for result in output.results:
                    task = asyncio.create_task(retrying("publish", functools.partial(self._store, result, out_at)))
                    self._storing.add(task)  # held, so the task is not collected mid-flight
                    task.add_done_callback(self._storing.discard)
            finally:
                self.queue.task_done()

    async def flushed(self) -> None:
        """Return once every step handed over so far is published and its results stored (a draining worker
        waits for this before it lets its jobs go)."""
        await self.queue.join()
        while self._storing:
            await asyncio.gather(*self._storing, return_exceptions=True)

    async def _publish_tokens(self, deltas: list[TokenDelta]) -> None:
        try:
            await retrying("publish tokens", lambda: self._jobs.publish_tokens(deltas))
        except SchemaError as exc:  # that job's end, stored later, fails the same way and dead-letters it
            log.error("token_events_unwritable", error=str(exc))

    async def _publish_step(self, deltas: list[TokenDelta], results: list[EngineResult], out_at: float) -> None:
        """A step's deltas and results in one round trip. After a lost connection its parts go again one by
        one (`publish` as with replicas, in order): its events may have been written, so repeating the
        round trip as a whole gains nothing over that."""
        finishing = [(result, job) for result in results if (job := self._running.get(result.job_id)) is not None]
        endings = [_ending(result, job, out_at) for result, job in finishing]  # canceled ones: acknowledged already
        try:
            done = await self._jobs.publish_step(deltas, endings)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("redis_unavailable", doing="publish step", error=str(exc))
            if deltas:
                await self._publish_tokens(deltas)
            for result in results:
                await retrying("publish", functools.partial(self._store, result, out_at))
            return
        if done.tokens_error is not None:
            log.error("token_events_unwritable", error=str(done.tokens_error))
        for (result, job), ended, stored in zip(finishing, endings, done.stored, strict=True):
            await retrying("publish", functools.partial(self._stored, result, job, ended.trace, stored))

    async def _store(self, result: EngineResult, out_at: float) -> None:
        """Store one result (taken from the engine thread at `out_at`, unix s) and acknowledge its entry, in
        one script. Safe to repeat: the job store keeps the first result."""
        job = self._running.get(result.job_id)
        if job is None:
            return  # canceled meanwhile: already acknowledged
        ending = _ending(result, job, out_at)
        try:
            stored: bool | SchemaError = await self._jobs.store_finish(ending)
        except SchemaError as exc:
            stored = exc
        await self._stored(result, job, ending.trace, stored)

    async def _stored(
        self, result: EngineResult, job: RunningJob, trace: JobTrace | None, stored: bool | SchemaError
    ) -> None:
        """After the finish script: the job leaves this worker, its entry dead-lettered if its record could not be
        written (the SchemaError)."""
        if isinstance(stored, SchemaError):
            log.error("unreadable_job_record", job=result.job_id, model=job.model, error=str(stored))
            await dead_letter(self._redis, job.model, job.stream, job.entry_id, job.fields, reason=str(stored))
            self._running.release(result.job_id)
            return
        self._running.release(result.job_id)
        if trace is not None:
            self._metrics.job_stages(job.model, trace, time.time())
        log.info(
            "job_finished",
            job=result.job_id,
            status=result.status.value,
            stored=stored,
            tokens=result.completion_tokens,
            error=result.error.code if result.error else None,
            request_id=job.request_id,
        )


def _ending(result: EngineResult, job: RunningJob, out_at: float) -> Finish:
    return Finish(
        result.job_id,
        result.status,
        output=result.output,
        error=result.error,
        completion_tokens=result.completion_tokens,
        first_token_ms=result.first_token_ms,
        entry=(job.stream, job.entry_id),
        trace=_trace(job, result, out_at),
    )


def _trace(job: RunningJob, result: EngineResult, out_at: float) -> JobTrace | None:
    """The job's way through this worker, from the I/O loop's and the engine thread's stamps (None: it was
    not started through the intake)."""
    if job.times is None:
        return None
    stamps = (job.times.created, job.times.read, job.times.started, result.added_at, result.first_token_at,
              result.finished_at, out_at)  # fmt: skip
    return JobTrace(*(int(stamp * 1e6) for stamp in stamps))


class CancelWatch:
    def __init__(self, redis: Redis, running: RunningJobs, engine_thread: EngineThread) -> None:
        self._redis = redis
        self._running = running
        self._engine_thread = engine_thread

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            await retrying("cancel watch", self._abort_canceled)

    async def _abort_canceled(self) -> None:
        """Stop running jobs that were canceled, or whose record vanished (expired TTL)."""
        job_ids = list(self._running.jobs)
        if not job_ids:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "status")
            # a record of another type answers an error: that job runs on, and its end is dead-lettered
            statuses = await pipe.execute(raise_on_error=False)
        for job_id, status in zip(job_ids, statuses, strict=True):
            job = self._running.get(job_id)
            if job is None or status not in (b"canceled", None):
                continue
            self._engine_thread.abort(job_id)
            await ack(self._redis, job.stream, job.entry_id)
            self._running.release(job_id)
            log.info("job_aborted", job=job_id, status=(status or b"missing").decode(), request_id=job.request_id)
