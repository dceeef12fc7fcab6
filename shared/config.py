"""Configuration dataclasses, one per process, built from CLI flags in cli/ and nowhere else."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A base model to serve: its public name and its HF-format directory."""

    name: str
    path: Path

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """Parse `NAME=PATH` as given to `--model`."""
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model expects NAME=PATH, got {text!r}")
        return cls(name=name, path=Path(path).expanduser().resolve())


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the gateway accepts in one job; anything beyond is a 4xx, never queued."""

    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 256_000
    max_output_tokens: int = 4096
    max_stop_strings: int = 8
    max_stop_chars: int = 128
    max_wait_s: float = 60.0  # longest long-poll one GET may hold
    max_deadline_s: float = 24 * 3600.0  # longest `deadline_s` a job may ask for
    max_completion_s: float = 600.0  # longest a non-streaming OpenAI completion waits for its job


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Admission limits per tenant (defaults; a tenant's own values, set through the admin API, win).
    Rates are token buckets refilled continuously, holding at most one minute's worth."""

    requests_per_min: int = 600
    tokens_per_min: int = 1_000_000  # prompt tokens + max_tokens of each job
    max_concurrent_jobs: int = 64  # queued + running
    # entries in a model's stream of one priority class (queued + running, all tenants)
    max_queue_per_model: int = 10_000

    def __post_init__(self) -> None:
        if min(self.requests_per_min, self.tokens_per_min, self.max_concurrent_jobs, self.max_queue_per_model) < 1:
            raise ValueError("every tenant limit must be >= 1")


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Where job webhooks may go and how they are delivered. Off unless hosts are allowed and a secret is set.

    `allow_hosts`: exact host names, or `*.example.com` for any subdomain. The secret signs every call
    (each tenant's signing key is derived from it: gateway/webhook_signature.py). A failed call is
    retried `retry_base_s` × 2ⁿ later, up to `max_attempts` calls; `retry_base_s` must outlast
    `timeout_s`, since a call still in flight past it counts as abandoned and may be retried.
    """

    allow_hosts: tuple[str, ...] = ()
    secret: str | None = None
    allow_http: bool = False  # plain-HTTP endpoints (a private network, tests); https otherwise
    timeout_s: float = 10.0
    retry_base_s: float = 15.0
    max_attempts: int = 8
    max_concurrent: int = 32  # calls in flight per gateway

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.retry_base_s <= self.timeout_s:
            raise ValueError("webhook retry_base_s must be longer than timeout_s, which must be > 0")
        if self.max_attempts < 1 or self.max_concurrent < 1:
            raise ValueError("webhook max_attempts and max_concurrent must be >= 1")

    @property
    def enabled(self) -> bool:
        return bool(self.allow_hosts) and bool(self.secret)


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    """How a write that must survive the loss of the Redis primary is confirmed: `WAIT replicas
    timeout_ms` after it. `replicas` 0 (a Redis without replicas): writes are not waited for."""

    replicas: int = 0
    timeout_ms: int = 1000

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms < 1:
            raise ValueError("replica wait: replicas must be >= 0 and timeout_ms >= 1")


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Files and batches (the OpenAI Files and Batch APIs). Files live in Redis, one list element per
    line, so every gateway reads them and a gateway restart loses nothing; their size is bounded here
    because Redis holds them in memory."""

    max_file_bytes: int = 32 << 20  # one uploaded file
    max_file_lines: int = 50_000  # requests in one batch input file (OpenAI's limit)
    max_files_per_tenant: int = 100  # uploaded files kept at once (batch-made ones do not count)
    file_ttl_s: int = 30 * 24 * 3600  # uploaded and batch-made files are removed this long after creation
    batch_ttl_s: int = 30 * 24 * 3600  # a finished batch's record, likewise
    completion_window_s: int = 24 * 3600  # the one window offered ("24h"): lines not done by then expire
    lines_in_flight: int = 512  # lines of one batch queued or running at once: the batch stream stays short
    driver_interval_s: float = 0.5  # how often a gateway's driver advances the batches it leases
    janitor_interval_s: float = 60.0  # how often expired files and batches are removed

    def __post_init__(self) -> None:
        sizes = (self.max_file_bytes, self.max_file_lines, self.max_files_per_tenant, self.file_ttl_s, self.batch_ttl_s)
        if min(*sizes, self.lines_in_flight) < 1:
            raise ValueError("batch limits must be >= 1")
        if min(self.completion_window_s, self.driver_interval_s, self.janitor_interval_s) <= 0:
            raise ValueError("batch intervals must be > 0")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str  # redis://... or redis+sentinel://... (shared/redis_client.py)
    host: str = "127.0.0.1"
    port: int = 8000
    job_ttl_s: int = 24 * 3600
    limits: RequestLimits = field(default_factory=RequestLimits)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    admin_key_sha256: str | None = None  # hex SHA-256 of the admin key; None turns the admin API off
    # where adapters registered through the admin API / load_lora_adapter must live (None: refused)
    adapter_root: Path | None = None
    max_lora_rank: int = 64
    max_adapter_bytes: int = 2 << 30
    webhooks: WebhookConfig = field(default_factory=WebhookConfig)
    batches: BatchConfig = field(default_factory=BatchConfig)
    # a known model that no worker has advertised for this long is refused (503) instead of queued:
    # long enough for a worker restart (its heartbeats resume once it has loaded its models)
    model_unserved_after_s: float = 120.0
    # a job is answered 202 only once this many replicas have it (503 replica_unavailable otherwise)
    replica_wait: ReplicaWait = field(default_factory=ReplicaWait)
    # place adapter jobs on the worker holding the adapter (gateway/routing.py); off: every job on the
    # model's shared stream, any worker takes any job
    adapter_routing: bool = True


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of one worker's engine. The KV cache gets `gpu_memory_utilization` of the GPU minus
    weights and adapters on CUDA, or `cpu_kv_cache_gb` on CPU, unless `num_kv_blocks` is given."""

    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's dtype
    # weights quantized at load ("fp8": W8A8, shared/quantization.py; "int4": W4A16 in groups of 128,
    # shared/int4_quantization.py; "nf4": W4A16 on bitsandbytes' NF4 levels in blocks of 64,
    # shared/bnb_quantization.py); None: as the checkpoint holds them
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # or "fp8": about twice the KV blocks in the same memory
    # affine 4-bit weights (int4, AWQ, GPTQ) of a bf16 model on CUDA also held in the tensor cores' layout,
    # whose kernel decodes one to six sequences 1.3-2x faster (kernels/quant/int4_mma.py); costs half a
    # byte a weight more. False: the KV cache gets that memory instead
    int4_decode_copy: bool = True
    max_num_seqs: int = 64  # sequences in the running batch
    max_seqs_per_tenant: int | None = None  # while others wait; None: half the batch
    # adapter grouping (worker/engine/scheduler.py): admission prefers waiting requests whose adapter the
    # step reads already, but overtakes a request at most this many times; 0: first-come first-served.
    # None: a quarter of max_num_seqs (`grouping_overtakes`)
    max_grouping_overtakes: int | None = None
    max_num_batched_tokens: int = 2048  # tokens one step may process (prefill chunks + decodes)
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # a hard cap on this process's share of the GPU (torch's per-process memory fraction), for
    # several processes on one GPU under MPS; the KV cache is sized within it. None: no cap
    gpu_memory_fraction: float | None = None
    cpu_kv_cache_gb: float = 0.5
    # the device's LoRA pool, in adapters of max_lora_rank (paged: more of lower rank fit). 0: LoRA off, the
    # model built without LoRA buffers, no adapter pool, and a job naming an adapter refused
    max_loras: int = 8
    max_lora_rank: int = 64
    max_adapter_bytes: int = 2 << 30
    # pinned host tier of the adapter pool; None: room for 2 * max_loras max-rank adapters. It must
    # hold at least max_loras of them (checked when the engine starts, knowing the model's shapes)
    adapter_host_cache_gb: float | None = None
    adapter_eviction: str = "lru"  # or "lfu": frequency-aware (worker/adapter_pool/eviction.py)
    # seconds a worker may spend at start tuning the LoRA plans its GPU lacks for a model, and as many
    # again for the W8A16 plans of a model served in fp8 (0: none); what the budget does not reach is
    # tuned at the next start (worker/kernel_plans.py)
    kernel_tune_budget_s: float = 120.0
    # processes (one per GPU) one model is split over by tensor parallelism; rank 0 is the worker
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be >= 1")
        if self.kernel_tune_budget_s < 0:
            raise ValueError("kernel_tune_budget_s must be >= 0")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_grouping_overtakes is not None and self.max_grouping_overtakes < 0:
            raise ValueError("max_grouping_overtakes must be >= 0 (0: first-come first-served)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.gpu_memory_fraction is not None and not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 (0: LoRA off) and max_lora_rank >= 1")
        if self.adapter_eviction not in ("lru", "lfu"):
            raise ValueError(f"adapter_eviction must be 'lru' or 'lfu', not {self.adapter_eviction!r}")
        if self.quantization not in (None, "fp8", "int4", "nf4"):
            raise ValueError(f"quantization must be 'fp8', 'int4', 'nf4' or unset, not {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', not {self.kv_cache_dtype!r}")
        if self.adapter_host_cache_gb is not None and self.adapter_host_cache_gb <= 0:
            raise ValueError("adapter_host_cache_gb must be > 0")

    @property
    def grouping_overtakes(self) -> int:
        """How often adapter grouping may overtake a waiting request: max_grouping_overtakes, by default a
        quarter of max_num_seqs. At saturation a batch admits about max_num_seqs requests in one request's
        time in it, so the extra wait grouping may cause is then about a quarter of that time, whatever
        the batch size (docs/benchmarks.md, issue #20: what the bound buys and costs)."""
        return self.max_num_seqs // 4 if self.max_grouping_overtakes is None else self.max_grouping_overtakes

    @property
    def lora_enabled(self) -> bool:
        return self.max_loras > 0


# how long a worker on SIGTERM lets running jobs finish before handing the rest back
DEFAULT_DRAIN_GRACE_S = 30.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    redis_url: str
    models: tuple[ModelSpec, ...]
    adapter_root: Path
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker_id: str = field(default_factory=default_worker_id)
    job_ttl_s: int = 24 * 3600
    heartbeat_interval_s: float = 2.0
    # a pending job whose worker has been silent this long is claimed by another worker
    claim_idle_ms: int = 60_000
    max_deliveries: int = 3
    # a job routed to another worker of a model that has waited there unread this long is taken by a
    # worker with free batch slots (worker/routed_streams.py)
    steal_after_ms: int = 500
    # on SIGTERM, running jobs get this long to finish; the rest are handed back to the queue
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    # base models on the device at once (None: all of them); the others wait warm or cold
    max_resident_models: int | None = None
    # the warm tier: checkpoints kept in (pinned) host memory, least recently used evicted first
    cpu_model_cache_bytes: int = 0
    # when switching models, the outgoing one's running jobs get this long before they are handed back
    switch_grace_s: float = 10.0
    # Prometheus metrics over HTTP on this port (0: not served); bind 0.0.0.0 where Prometheus scrapes pods
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # LoRA plans tuned on this machine, searched before the packaged kernels/configs/ and written by the
    # start-up tune (worker/kernel_plans.py). None: the packaged plans only
    kernel_plans_dir: Path | None = None
    # registered adapter names read into the host cache at start, before serving (warm after a restart)
    preload_adapters: tuple[str, ...] = ()
    # a job's result and its acknowledgement are confirmed by this many replicas before the job counts as done
    replica_wait: ReplicaWait = field(default_factory=ReplicaWait)

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("heartbeat_interval_s must be > 0 and drain_grace_s >= 0")
        if self.claim_idle_ms < 3 * self.heartbeat_interval_s * 1000:
            # a live worker renews its running jobs every heartbeat; a shorter idle time would let
            # another worker steal them between two renewals
            raise ValueError("claim_idle_ms must be at least three heartbeat intervals")
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        if self.steal_after_ms < 1:
            raise ValueError("steal_after_ms must be >= 1")
        if self.max_resident_models is not None and self.max_resident_models < 1:
            raise ValueError("max_resident_models must be >= 1")
        if self.cpu_model_cache_bytes < 0 or self.switch_grace_s < 0:
            raise ValueError("cpu_model_cache_bytes and switch_grace_s must be >= 0")
        if self.preload_adapters and not self.engine.lora_enabled:
            raise ValueError("preload_adapters needs LoRA: max_loras is 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be a TCP port, or 0 for none")
