"""What the worker tells the fleet: at start, every model it serves (resident or not) with what its
adapter pool can serve of adapters; every heartbeat, its own record (`lf:worker:{id}`: models and
their tiers and quantization, load, resident adapters, jobs waiting on its routed streams, jobs started
by arrival and adapter tier), the served stamp of each model, its routed streams listed, and a renewed
claim on every running entry so that no live job is taken over; the moment it stops reading, it hands
the jobs routed to it and not started to the shared streams and withdraws all of that (a draining
worker only renews its claims). The gateway routes by this record (gateway/routing.py)."""

from __future__ import annotations

import json

from redis.asyncio import Redis

from shared import keys
from shared.chat_template import read_chat_template
from shared.config import WorkerConfig
from shared.jobstore import now_ms
from shared.model_registry import forget_worker, mark_served, publish_model
from worker.adapter_pool.limits import adapter_limits
from worker.job_stream import ensure_group, shared_streams
from worker.metrics import WorkerMetrics
from worker.routed_streams import RoutedStreams
from worker.running_jobs import RunningJobs
from worker.switching.residency import ModelResidency
from worker.switching.switcher import ModelSwitcher


class Heartbeat:
    def __init__(
        self,
        redis: Redis,
        config: WorkerConfig,
        running: RunningJobs,
        residency: ModelResidency,
        metrics: WorkerMetrics,
    ) -> None:
        self._redis = redis
        self._config = config
        self._running = running
        self._residency = residency
        self._limits = {name: adapter_limits(info, config.engine) for name, info in residency.infos.items()}
        self._streams = RoutedStreams(redis, config.worker_id)
        self._metrics = metrics

    async def announce(self) -> None:
        """Publish every served model, resident or not: the gateway accepts jobs for all of them."""
        for spec in self._config.models:
            tokenizer_json = (spec.path / "tokenizer.json").read_bytes()
            await publish_model(
                self._redis,
                self._residency.infos[spec.name],
                tokenizer_json,
                read_chat_template(spec.path),
                worker_id=self._config.worker_id,
                limits=self._limits[spec.name],
            )
            for stream in shared_streams(spec.name):
                await ensure_group(self._redis, stream)
            await self._streams.register(spec.name)

    async def beat(self, switcher: ModelSwitcher) -> None:
        """Advertise this worker, and renew the claim on every running entry so no live job is stolen."""
        await self.renew_claims()
        worker_id = self._config.worker_id
        async with self._redis.pipeline(transaction=False) as pipe:
            for spec in self._config.models:  # again every beat: a restarted Redis may have lost them
                pipe.sadd(keys.worker_queues(spec.name), self._streams.own(spec.name))
                pipe.xlen(self._streams.own(spec.name))
            replies = await pipe.execute()
        own_lengths = replies[1::2]
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                keys.worker(worker_id),
                mapping={
                    "models": json.dumps([spec.name for spec in self._config.models]),
                    **{name: json.dumps(value) for name, value in switcher.report().items()},
                    "device": self._config.engine.device,
                    "in_flight": len(self._running),
                    "capacity": self._running.capacity,
                    "adapters": json.dumps(self._resident_adapters()),
                    "quantization": json.dumps(self._quantization()),
                    "routed_waiting": json.dumps(self._routed_waiting(own_lengths)),
                    "started": json.dumps(self._metrics.started_counts),
                    "updated_ms": now_ms(),
                },
            )
            pipe.expire(keys.worker(worker_id), max(3, int(self._config.heartbeat_interval_s * 3)))
            for spec in self._config.models:
                mark_served(pipe, spec.name, now_ms(), worker_id=worker_id, limits=self._limits[spec.name])
            pipe.sadd(keys.WORKERS, worker_id)
            await pipe.execute()

    async def renew_claims(self) -> None:
        """Reset the idle time of every running entry, on whichever stream holds it (a draining worker does
        this, advertising nothing)."""
        worker_id = self._config.worker_id
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, entry_ids in self._running.entries_by_stream().items():
                pipe.xclaim(stream, keys.WORKER_GROUP, worker_id, min_idle_time=0, message_ids=entry_ids, justid=True)
            await pipe.execute(raise_on_error=False)  # a stream Redis lost: its jobs' results still store

    async def withdraw(self) -> None:
        """At stop: this worker's record and its adapter limits go (the record would expire anyway), then the
        jobs routed here and not read go to the shared streams. Deletions first: they pass even a Redis out
        of memory, which refuses the hand-over's writes, and the gateway stops routing here the sooner."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.worker(self._config.worker_id))
            pipe.srem(keys.WORKERS, self._config.worker_id)
            for spec in self._config.models:
                forget_worker(pipe, spec.name, self._config.worker_id)
            await pipe.execute()
        for spec in self._config.models:
            await self._streams.hand_over_own(spec.name)

    def _quantization(self) -> dict[str, dict[str, object]]:
        """Per served model: its weights' format ("none", "fp8", "int4", "awq", "gptq", "nf4" or "fp4"),
        the projections a mixed-precision checkpoint leaves in its own dtype, and its KV cache's dtype."""
        return {
            name: {
                "weights": info.quantization,
                "unquantized_projections": info.unquantized_summary(),
                "kv_cache": info.kv_cache_dtype,
            }
            for name, info in self._residency.infos.items()
        }

    def _routed_waiting(self, own_lengths: list[int]) -> dict[str, int]:
        """Per model: jobs on this worker's own stream it has not started (the gateway's measure of its queue)."""
        running_own: dict[str, int] = {}
        for job in self._running.jobs.values():
            if job.stream == self._streams.own(job.model):
                running_own[job.model] = running_own.get(job.model, 0) + 1
        return {
            spec.name: max(0, length - running_own.get(spec.name, 0))
            for spec, length in zip(self._config.models, own_lengths, strict=True)
        }

    def _resident_adapters(self) -> dict[str, dict[str, list[str]]]:
        """Per resident model: adapter uids in device slots and in pinned host memory, as of its
        engine's last step (the pool publishes them as one tuple, safe to read from this thread)."""
        adapters = {}
        for name, engine in dict(self._residency.engines).items():  # a copy: the engine thread may swap models
            gpu, cpu = engine.adapter_pool.resident if engine.adapter_pool is not None else ((), ())  # LoRA off
            adapters[name] = {"gpu": list(gpu), "cpu": list(cpu)}
        return adapters
