"""The worker's Prometheus metrics, served over HTTP from the worker process (`lorafleet worker --metrics-port`).

Four groups, one registry per worker (so several workers in one test process never collide):
- engine series, per served model: the engine thread records them once per step from the counts
  the engine keeps (`StepStats`, `EngineLoad`: plain numbers, so this module knows nothing of the
  engine; no device sync, nothing per token, a few lock-protected adds per step);
- adapter-pool series, per model and tier (gpu / cpu / disk): the adapter pool records hits, misses,
  evictions, load latency and residency through `AdapterMetrics`;
- GPU utilisation, memory, clocks, power, temperature and clock slowdowns, read from NVML at scrape
  time (worker/gpu_metrics.py); a worker without a GPU simply has no such series;
- the process's CPU time and memory (prometheus_client's process collector, `process_*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from shared.schema import JobTrace
from worker.gpu_metrics import GpuCollector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_STAGE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                    1, 2, 4, 8, 16, 32)  # fmt: skip
_LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step ran: sequences in its batch, tokens it processed, tokens it sampled, distinct
    adapters its batch read (the base model not counted)."""

    num_seqs: int = 0
    num_tokens: int = 0
    num_sampled: int = 0
    num_adapters: int = 0
    # seconds the device sat idle before the host began the step whose tokens this one read: the mark is
    # recorded before the step's inputs are built, so a launch delayed inside a step counts as step time,
    # not here (None: not measured: a CPU engine, or that step was begun with none before it in flight)
    device_idle_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's queues and KV cache at one moment; `preemptions` counts since the engine started."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    running_batch: int = 0  # of `running`, batch-class sequences (the rest are interactive)
    waiting_batch: int = 0  # of `waiting`, likewise


# The stages between a job's trace points (shared/schema.py JobTrace), then its result's store:
# queue (made by the gateway → read by this worker: two processes' clocks), start (the start script),
# handoff (→ the engine thread took it), prefill (→ its first token), decode (→ its last token),
# out (the engine thread → the I/O loop took its result), store (the finish script).
JOB_STAGES = ("queue", "start", "handoff", "prefill", "decode", "out", "store")


class AdapterTier(StrEnum):
    """Where an adapter's weights were found: device slots, pinned host memory, or PEFT files on disk."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


class WorkerMetrics:
    """Every series one worker exports; `engine(model)` hands out the recorder for one served model."""

    def __init__(self, device: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model"]
        tier_labels = ["model", "tier"]
        self.running_seqs = Gauge(
            "lorafleet_worker_running_seqs", "sequences in the running batch", labels, registry=self.registry
        )
        self.waiting_seqs = Gauge(
            "lorafleet_worker_waiting_seqs", "sequences waiting to be admitted", labels, registry=self.registry
        )
        self.class_seqs = Gauge(
            "lorafleet_worker_class_seqs",
            "sequences of one priority class, running or waiting",
            ["model", "priority", "state"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "lorafleet_worker_batch_size", "sequences in one engine step", labels, buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "lorafleet_worker_batch_tokens", "tokens one engine step processed (prefill chunks + decodes)", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_adapters = Histogram(
            "lorafleet_worker_batch_adapters", "distinct adapters one engine step read (the LoRA kernels' cost "
            "grows with them)", labels, buckets=_BATCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "lorafleet_worker_step_seconds", "wall time of one engine step (schedule, forward, sample)", labels,
            buckets=_STEP_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.device_idle_seconds = Histogram(
            "lorafleet_worker_device_idle_seconds",
            "the device's idle time between two back-to-back engine steps, until the host began the later "
            "(marked before its inputs are built: a delay inside a step counts as step time)",
            labels, buckets=_STAGE_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.generated_tokens = Counter(
            "lorafleet_worker_generated_tokens", "output tokens sampled", labels, registry=self.registry
        )
        self.preemptions = Counter(
            "lorafleet_worker_preemptions", "running sequences preempted for KV-cache room (recomputed later)",
            labels, registry=self.registry,
        )  # fmt: skip
        self.kv_blocks_used = Gauge(
            "lorafleet_worker_kv_blocks_used", "KV-cache blocks held by sequences", labels, registry=self.registry
        )
        self.kv_blocks_total = Gauge(
            "lorafleet_worker_kv_blocks_total", "KV-cache blocks of the model's cache", labels, registry=self.registry
        )
        self.adapter_hits = Counter(
            "lorafleet_worker_adapter_hits", "adapter lookups answered by a tier", tier_labels, registry=self.registry
        )
        self.adapter_misses = Counter(
            "lorafleet_worker_adapter_misses", "adapter lookups a tier could not answer", tier_labels,
            registry=self.registry,
        )  # fmt: skip
        self.adapter_evictions = Counter(
            "lorafleet_worker_adapter_evictions", "adapters evicted from a tier", tier_labels, registry=self.registry
        )
        self.adapter_load_seconds = Histogram(
            "lorafleet_worker_adapter_load_seconds", "time to bring an adapter up from a tier", tier_labels,
            buckets=_LOAD_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.adapters_resident = Gauge(
            "lorafleet_worker_adapters_resident", "adapters held in a tier", tier_labels, registry=self.registry
        )
        self.jobs_started = Counter(
            "lorafleet_worker_jobs_started",
            "jobs started, by how they reached this worker (routed, shared, stolen, reclaimed) and where their "
            "adapter was when they were read (gpu, cpu, disk; none: the base model)",
            ["model", "arrival", "tier"], registry=self.registry,
        )  # fmt: skip
        self.job_stage_seconds = Histogram(
            "lorafleet_worker_job_stage_seconds",
            "a finished job's time in each stage of its way through the worker (stages: JOB_STAGES)",
            ["model", "stage"], buckets=_STAGE_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        # the same counts as plain numbers, for the heartbeat: the fleet's hit rate without Prometheus
        self.started_counts: dict[str, int] = {}
        # the process's CPU seconds and memory (process_*): what the I/O loop and the engine thread cost the host
        ProcessCollector(registry=self.registry)
        gpus = GpuCollector.for_device(device)
        if gpus is not None:
            self.registry.register(gpus)

    def engine(self, model: str) -> EngineMetrics:
        return EngineMetrics(self, model)

    def job_started(self, model: str, arrival: str, tier: str) -> None:
        """A job started here: how it arrived (worker/intake.py) and its adapter's tier at that moment."""
        self.jobs_started.labels(model, arrival, tier).inc()
        key = f"{arrival}/{tier}"
        self.started_counts[key] = self.started_counts.get(key, 0) + 1

    def job_stages(self, model: str, trace: JobTrace, stored_at: float) -> None:
        """A job's result was stored at `stored_at` (unix s): the time it spent in each stage, from its trace."""
        points = [getattr(trace, point) / 1e6 for point in JobTrace.FIELDS] + [stored_at]
        for stage, since, until in zip(JOB_STAGES, points[:-1], points[1:], strict=True):
            if since and until >= since:  # a point not reached (0) leaves its stages out
                self.job_stage_seconds.labels(model, stage).observe(until - since)

    def serve(self, host: str, port: int) -> WSGIServer:
        """Serve `/metrics` (any path, in fact) on a daemon thread; `shutdown()` the result to stop."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class AdapterMetrics:
    """The adapter pool's recorder for one model: every call is a lock-protected add, safe from any thread."""

    def __init__(self, metrics: WorkerMetrics, model: str) -> None:
        # children resolved once: recording is then a plain add, and every tier's series exists from 0
        self._hits = {tier: metrics.adapter_hits.labels(model, tier) for tier in AdapterTier}
        self._misses = {tier: metrics.adapter_misses.labels(model, tier) for tier in AdapterTier}
        self._evictions = {tier: metrics.adapter_evictions.labels(model, tier) for tier in AdapterTier}
        self._load_seconds = {tier: metrics.adapter_load_seconds.labels(model, tier) for tier in AdapterTier}
        self._resident = {tier: metrics.adapters_resident.labels(model, tier) for tier in AdapterTier}

    def hit(self, tier: AdapterTier) -> None:
        self._hits[tier].inc()

    def miss(self, tier: AdapterTier) -> None:
        self._misses[tier].inc()

    def evicted(self, tier: AdapterTier) -> None:
        self._evictions[tier].inc()

    def loaded(self, tier: AdapterTier, seconds: float) -> None:
        """An adapter was brought up from `tier` (e.g. disk → pinned host, host → device slot) in `seconds`."""
        self._load_seconds[tier].observe(seconds)

    def set_resident(self, tier: AdapterTier, count: int) -> None:
        self._resident[tier].set(count)


class EngineMetrics:
    """Recorder for one model's engine (`WorkerMetrics.engine(model)`)."""

    def __init__(self, metrics: WorkerMetrics, model: str) -> None:
        self.adapters = AdapterMetrics(metrics, model)
        self._running = metrics.running_seqs.labels(model)
        self._waiting = metrics.waiting_seqs.labels(model)
        self._class_seqs = {
            (priority, state): metrics.class_seqs.labels(model, priority, state)
            for priority in ("interactive", "batch")
            for state in ("running", "waiting")
        }
        self._batch_size = metrics.batch_size.labels(model)
        self._batch_tokens = metrics.batch_tokens.labels(model)
        self._batch_adapters = metrics.batch_adapters.labels(model)
        self._step_seconds = metrics.step_seconds.labels(model)
        self._device_idle_seconds = metrics.device_idle_seconds.labels(model)
        self._generated = metrics.generated_tokens.labels(model)
        self._preemptions = metrics.preemptions.labels(model)
        self._kv_used = metrics.kv_blocks_used.labels(model)
        self._kv_total = metrics.kv_blocks_total.labels(model)
        self._preemptions_seen = 0

    def record_step(self, step: StepStats, load: EngineLoad, seconds: float) -> None:
        """After one engine step that took `seconds`: its batch, and the queues and KV cache it left."""
        if step.num_seqs:
            self._batch_size.observe(step.num_seqs)
            self._batch_tokens.observe(step.num_tokens)
            self._batch_adapters.observe(step.num_adapters)
            self._generated.inc(step.num_sampled)
            self._step_seconds.observe(seconds)
        if step.device_idle_s is not None:
            self._device_idle_seconds.observe(step.device_idle_s)
        self.record_load(load)

    def record_load(self, load: EngineLoad) -> None:
        """The queues and KV cache as an engine has them now (the adapter pool records its own tiers)."""
        self._running.set(load.running)
        self._waiting.set(load.waiting)
        self._class_seqs["interactive", "running"].set(load.running - load.running_batch)
        self._class_seqs["interactive", "waiting"].set(load.waiting - load.waiting_batch)
        self._class_seqs["batch", "running"].set(load.running_batch)
        self._class_seqs["batch", "waiting"].set(load.waiting_batch)
        self._kv_used.set(load.kv_blocks_used)
        self._kv_total.set(load.kv_blocks_total)
        if load.preemptions != self._preemptions_seen:
            self._preemptions.inc(load.preemptions - self._preemptions_seen)
            self._preemptions_seen = load.preemptions
