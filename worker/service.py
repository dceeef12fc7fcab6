"""The worker process: Redis streams in, engine steps in a thread, results back to Redis.

Delivery is at-least-once: a stream entry is acknowledged only after its job's final state is
stored. While a job runs, this worker keeps re-claiming its entry so its idle time stays low; an
entry whose worker died goes idle and another worker claims it (XAUTOCLAIM) and runs it again.
The job store's Lua scripts make sure only one result is ever stored.

Every loop survives losing Redis (worker/redis_retry.py): the client retries a command through a
short restart, and past that the loop logs, backs off and tries again, holding on to any result it
has not stored yet. On `stop()` (a signal, or a loop that failed) the worker drains: it reads no
more jobs and withdraws its heartbeat at once, gives running ones `drain_grace_s` to finish, and puts
the rest back on their queue as new entries that any worker can take at once. The whole stop is
bounded (drain_grace_s + STOP_MARGIN_S); a loop that ignores its cancellation is left behind.

This module wires the parts and owns the process's life (start, stop, drain, crash): jobs in
(intake.py), out (results.py), what the fleet is told (heartbeat.py), the jobs running here
(running_jobs.py), and, for a worker serving more base models than it keeps resident, switching
between them (switching/switcher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from shared.config import WorkerConfig
from shared.jobstore import JobStore
from shared.redis_client import resilient_redis
from shared.schema import SchemaError
from shared.tasks import TASK_STOP_S, cancel_and_wait
from worker.adapter_preload import preload_adapters
from worker.engine.engine import LLMEngine
from worker.engine_thread import EngineThread
from worker.heartbeat import Heartbeat
from worker.intake import Intake
from worker.job_stream import dead_letter, requeue
from worker.kernel_plans import tune_at_start
from worker.metrics import WorkerMetrics
from worker.model.parallel.sharding import shard_info
from worker.redis_retry import retrying
from worker.results import CancelWatch, ResultPublisher
from worker.routed_streams import RoutedStreams
from worker.running_jobs import RunningJob, RunningJobs
from worker.switching.residency import ModelResidency
from worker.switching.switcher import ModelSwitcher
from worker.tensor_parallel import Followers

log = structlog.get_logger(__name__)

_SOCKET_TIMEOUT_S = 10.0  # outlasts the XREADGROUP block; a dead connection is noticed this fast
STOP_MARGIN_S = 10.0  # the stop sequence's time beyond drain_grace_s: the engine's last step, handing back


@dataclass(frozen=True, slots=True)
class _Loops:
    """The worker's loops, by the order a stop ends them in."""

    consume: asyncio.Task
    heartbeat: asyncio.Task
    publish: asyncio.Task
    others: list[asyncio.Task]

    @property
    def all(self) -> list[asyncio.Task]:
        return [self.consume, self.heartbeat, self.publish, *self.others]


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id = config.worker_id
        self._redis = resilient_redis(config.redis_url, socket_timeout_s=_SOCKET_TIMEOUT_S)
        self._jobs = JobStore(self._redis, config.job_ttl_s, replica_wait=config.replica_wait)
        # a queue beyond the batch, so admission never idles; batch jobs take at most one batch's worth of it,
        # so interactive jobs always find room here and reach the engine's scheduler, which preempts batch work
        self._running = RunningJobs(capacity=config.engine.max_num_seqs * 2, batch_capacity=config.engine.max_num_seqs)
        self._stopping = asyncio.Event()
        self._crash: BaseException | None = None
        self._engine_thread: EngineThread | None = None
        self.metrics = WorkerMetrics(config.engine.device)
        self._results = ResultPublisher(self._redis, self._jobs, self._running, self.metrics)
        # a model over several GPUs: the other ranks' processes, started and joined before anything loads
        self._followers = Followers(config) if config.engine.tensor_parallel > 1 else None
        channel = self._followers.channel if self._followers is not None else None
        self._residency = ModelResidency(config, self.metrics, channel)  # plans the device's memory: fails early
        self._heartbeat = Heartbeat(self._redis, config, self._running, self._residency, self.metrics)
        self._switcher: ModelSwitcher | None = None

    async def run(self) -> int:
        """Serve until `stop()`; returns the process exit code."""
        loop = asyncio.get_running_loop()
        if self._followers is not None:  # a rank that dies crashes the worker, loading or serving
            self._followers.watch(lambda exc: loop.call_soon_threadsafe(self._engine_crashed, exc))
        metrics_server = None
        if self.config.metrics_port:  # before the model loads: a taken port fails in seconds, not minutes
            metrics_server = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
            log.info("metrics_serving", host=self.config.metrics_host, port=self.config.metrics_port)
        # the shapes this process runs: a tensor-parallel rank's share of each projection
        size = self.config.engine.tensor_parallel
        infos = [info if size == 1 else shard_info(info, size) for info in self._residency.infos.values()]
        await asyncio.to_thread(tune_at_start, infos, self.config.engine, self.config.kernel_plans_dir)
        engines = await asyncio.to_thread(self._load_engines)
        if self.config.preload_adapters:  # before the engine thread steps: the pools are still this thread's
            await preload_adapters(self._redis, self.config.preload_adapters, engines)
        steps = self._results.queue
        self._engine_thread = EngineThread(
            engines,
            on_output=lambda output: loop.call_soon_threadsafe(steps.put_nowait, output),
            on_crash=lambda exc: loop.call_soon_threadsafe(self._engine_crashed, exc),
        )
        self._engine_thread.start()
        self._switcher = ModelSwitcher(
            self._residency,
            self._engine_thread,
            self._redis,
            claim_idle_ms=self.config.claim_idle_ms,
            switch_grace_s=self.config.switch_grace_s,
            in_flight=self._running.load_of,
            hand_back=self._hand_back_model,
            release_routed=RoutedStreams(self._redis, self.id).hand_over_own,
        )
        intake = Intake(
            self._redis,
            self._jobs,
            self.config,
            self._running,
            self._engine_thread,
            self._switcher,
            self._stopping,
            self.metrics,
        )
        await retrying("announce", self._heartbeat.announce)
        log.info("worker_ready", worker=self.id, models=[s.name for s in self.config.models], resident=list(engines))
        loops = _Loops(
            consume=asyncio.create_task(self._consume(intake), name="consume"),
            heartbeat=asyncio.create_task(self._beat(), name="heartbeat"),
            publish=asyncio.create_task(self._results.publish(), name="publish"),
            others=[
                asyncio.create_task(
                    CancelWatch(self._redis, self._running, self._engine_thread).watch(), name="cancels"
                ),
                asyncio.create_task(self._manage_models(), name="models"),
            ],
        )
        for task in loops.all:
            task.add_done_callback(self._task_done)
        await self._stopping.wait()
        await self._stop_within_grace(loops)
        await self._redis.aclose()
        if self._followers is not None:  # told to stop only if no engine step can still be talking to them
            engine_ended = self._engine_thread is None or not self._engine_thread.alive
            await asyncio.to_thread(self._followers.stop, tell=engine_ended)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)  # waits out its poll interval (0.5 s)
            metrics_server.server_close()
        log.info("worker_stopped", worker=self.id, crashed=self._crash is not None)
        return 1 if self._crash is not None else 0

    def stop(self) -> None:
        if not self._stopping.is_set():
            log.info("worker_stopping", worker=self.id, running=len(self._running))
        self._stopping.set()
        self._running.room.set()  # wake the consumer if it waits for room

    async def _stop_within_grace(self, loops: _Loops) -> None:
        """Run the stop sequence, for at most drain_grace_s + STOP_MARGIN_S: past that (Redis away, a
        task that ignores its cancellation) it is left behind and the worker exits as crashed."""
        stopping = asyncio.create_task(self._stop_serving(loops), name="stop")
        await asyncio.wait([stopping], timeout=self.config.drain_grace_s + STOP_MARGIN_S)
        if not stopping.done():
            log.error("stop_overran", grace_s=self.config.drain_grace_s, margin_s=STOP_MARGIN_S)
            self._crash = self._crash or TimeoutError("the stop overran its grace period")
            await cancel_and_wait([stopping], TASK_STOP_S)
        elif stopping.exception() is not None:
            log.error("stop_failed", exc_info=stopping.exception())
            self._crash = self._crash or stopping.exception()

    async def _stop_serving(self, loops: _Loops) -> None:
        """Stop reading and at once stop advertising (the gateway must not take jobs nobody reads), drain,
        then end the other loops."""
        await cancel_and_wait([loops.heartbeat], TASK_STOP_S)
        claims = asyncio.create_task(self._renew_claims(), name="claims")  # running jobs stay ours meanwhile
        with contextlib.suppress(RedisError):  # the heartbeat key expires by itself if Redis is away
            await self._heartbeat.withdraw()
        await asyncio.gather(loops.consume, return_exceptions=True)  # returns within one read block
        await self._drain(loops.publish)
        await cancel_and_wait([claims, loops.publish, *loops.others], TASK_STOP_S)

    # -- start-up and failure -------------------------------------------------------------------

    def _load_engines(self) -> dict[str, LLMEngine]:
        """Make the first models given resident, as many as the residency has slots for."""
        for spec in self.config.models[: self._residency.slots]:
            self._residency.activate(self._residency.prepare(spec.name))
        return self._residency.engines

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

    # -- loops ----------------------------------------------------------------------------------

    async def _consume(self, intake: Intake) -> None:
        while not self._stopping.is_set():
            await retrying("consume", intake.consume_once)

    async def _beat(self) -> None:
        while True:
            await retrying("heartbeat", lambda: self._heartbeat.beat(self._switcher))
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _renew_claims(self) -> None:
        """A stopping worker's heartbeat: its running entries' claims only, nothing advertised."""
        while True:
            await retrying("renew claims", self._heartbeat.renew_claims)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _manage_models(self) -> None:
        while True:
            await retrying("model switching", self._switcher.run)

    # -- handing jobs back ----------------------------------------------------------------------

    async def _hand_back_model(self, model: str) -> int:
        """Abort `model`'s running jobs in the engine and queue them again (a switch past its grace)."""
        jobs = self._running.of_model(model)
        for job_id, job in jobs:
            self._engine_thread.abort(job_id)
            await retrying("hand back", lambda job_id=job_id, job=job: self._hand_back(job_id, job))
        return len(jobs)

    async def _drain(self, publish: asyncio.Task) -> None:
        """Give running jobs `drain_grace_s` to finish (their results stored), then hand the rest back."""
        deadline = time.monotonic() + self.config.drain_grace_s
        while len(self._running) and self._crash is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self._engine_thread.stop)
        # results of the engine's last step are stored before we let go, unless the loop storing them failed
        stored = asyncio.create_task(self._results.flushed())
        await asyncio.wait([stored, publish], return_when=asyncio.FIRST_COMPLETED)
        stored.cancel()
        if not len(self._running):
            return
        log.warning("drain_incomplete", handed_back=len(self._running), crashed=self._crash is not None)
        for job_id, job in list(self._running.jobs.items()):
            await retrying("hand back", lambda job_id=job_id, job=job: self._hand_back(job_id, job))

    async def _hand_back(self, job_id: str, job: RunningJob) -> None:
        # a graceful stop does not count as a delivery; after an engine crash it does, so a job that
        # crashes every engine it meets ends in the dead-letter stream instead of looping
        try:
            ours = self._crash is not None or await self._jobs.release(job_id, self.id)
        except SchemaError as exc:  # its record became unreadable while it ran
            await dead_letter(self._redis, job.model, job.stream, job.entry_id, job.fields, reason=str(exc))
        else:
            if not ours:  # another worker took its entry over (this one stalled past claim_idle_ms): it runs it
                self._running.pop(job_id)
                log.info("job_let_go", job=job_id, request_id=job.request_id)
                return
            await requeue(self._redis, job.model, job.priority, job.stream, job.entry_id, job.fields)
        self._running.pop(job_id)
        log.info("job_handed_back", job=job_id, request_id=job.request_id)
