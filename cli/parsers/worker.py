"""The parser of `worker`: where the fleet is, delivery, metrics, engine sizes, kernel plans, models."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import commands, flag_types
from cli.parsers.common import ENGINE_DEFAULTS, WORKER_DEFAULTS, add_redis_flags, add_replica_wait_flags


def add_worker(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser("worker", help="run one worker process (one GPU, or the CPU)")
    add_redis_flags(worker)
    add_replica_wait_flags(worker)
    worker.add_argument(
        "--model", type=flag_types.model_spec, action="append", metavar="NAME=PATH", help="model to serve (repeatable)"
    )
    worker.add_argument("--adapter-root", type=Path, help="adapter paths are relative to this")
    worker.add_argument(
        "--device",
        type=flag_types.device_name,
        default="auto",
        help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)",
    )
    worker.add_argument("--worker-id", help="name in heartbeats and job records (default: HOST-PID)")
    delivery = worker.add_argument_group("delivery")
    delivery.add_argument(
        "--heartbeat-interval",
        type=flag_types.seconds,
        default=WORKER_DEFAULTS.heartbeat_interval_s,
        help="seconds between heartbeats, which also renew the claim on running jobs (default: %(default)s)",
    )
    delivery.add_argument(
        "--claim-idle-ms",
        type=flag_types.positive_int,
        default=WORKER_DEFAULTS.claim_idle_ms,
        help="a running job not renewed for this long is taken over by another worker (default: %(default)s)",
    )
    delivery.add_argument(
        "--steal-after-ms",
        type=flag_types.positive_int,
        default=WORKER_DEFAULTS.steal_after_ms,
        help="a job routed to another worker that waited there unread this long is taken by a worker with "
        "free batch slots (default: %(default)s)",
    )
    delivery.add_argument(
        "--max-deliveries",
        type=flag_types.positive_int,
        default=WORKER_DEFAULTS.max_deliveries,
        help="a job started more often than this is failed and dead-lettered (default: %(default)s)",
    )
    delivery.add_argument(
        "--drain-grace",
        type=flag_types.seconds,
        default=WORKER_DEFAULTS.drain_grace_s,
        help="on SIGTERM, seconds running jobs get to finish before they are handed back (default: %(default)s)",
    )
    metrics = worker.add_argument_group("Prometheus metrics")
    metrics.add_argument(
        "--metrics-port",
        type=flag_types.port_or_off,
        default=WORKER_DEFAULTS.metrics_port,
        help="serve the worker's metrics over HTTP on this port; 0: off (default: %(default)s)",
    )
    metrics.add_argument(
        "--metrics-host",
        default=WORKER_DEFAULTS.metrics_host,
        help="bind address of the metrics port (default: %(default)s)",
    )
    engine = worker.add_argument_group("engine sizes")
    engine.add_argument(
        "--tensor-parallel",
        type=flag_types.positive_int,
        default=ENGINE_DEFAULTS.tensor_parallel,
        help="split one model over this many GPUs (from --device's on), one process each; this process is "
        "rank 0 and starts the others (default: %(default)s)",
    )
    engine.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), help="weights' dtype (default: the checkpoint's)"
    )
    engine.add_argument(
        "--quantization",
        choices=("fp8", "int4", "nf4"),
        help="quantize the base weights at load: fp8 = W8A8, per-channel weight and per-token activation scales; "
        "int4 = W4A16, 4-bit weights in groups of 128 with a scale and zero point each; "
        "nf4 = W4A16, bitsandbytes' NF4 levels in blocks of 64 with an absmax each; "
        "FP8, AWQ, GPTQ and bitsandbytes 4-bit checkpoints load as they are (default: as the checkpoint holds them)",
    )
    engine.add_argument(
        "--int4-decode-copy",
        action=argparse.BooleanOptionalAction,
        default=ENGINE_DEFAULTS.int4_decode_copy,
        help="hold affine 4-bit weights (int4, AWQ, GPTQ) of a bf16 model on CUDA a second time in the tensor "
        "cores' layout, for 1.3-2x faster decode of one to six sequences at half a byte a weight; "
        "--no-int4-decode-copy gives that memory to the KV cache (default: on)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default=ENGINE_DEFAULTS.kv_cache_dtype,
        help="the KV cache's dtype; fp8 holds about twice the blocks (default: %(default)s, the activations')",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=flag_types.positive_int,
        default=ENGINE_DEFAULTS.max_num_seqs,
        help="sequences in the running batch (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=flag_types.positive_int,
        default=ENGINE_DEFAULTS.max_num_batched_tokens,
        help="tokens one engine step may process (default: %(default)s)",
    )
    engine.add_argument(
        "--max-grouping-overtakes",
        type=flag_types.count,
        help="admission prefers waiting requests whose adapter the running batch reads already (fewer distinct "
        "adapters a step, so cheaper LoRA); a request is overtaken so at most this many times, then admitted "
        "in arrival order. 0: strict arrival order (default: a quarter of --max-num-seqs)",
    )
    engine.add_argument(
        "--max-loras",
        type=flag_types.count,
        default=ENGINE_DEFAULTS.max_loras,
        help="the device's LoRA pool, in adapters of --max-lora-rank; it is paged by 16 ranks, so more adapters "
        "of lower rank fit. 0: LoRA off (no LoRA memory, jobs naming an adapter refused) (default: %(default)s)",
    )
    engine.add_argument(
        "--max-lora-rank",
        type=flag_types.positive_int,
        default=ENGINE_DEFAULTS.max_lora_rank,
        help="(default: %(default)s)",
    )
    engine.add_argument(
        "--adapter-host-cache-gb",
        type=flag_types.gigabytes,
        help="pinned host memory for adapters read from disk, at least the device pool's --max-loras max-rank "
        "adapters (default: twice that)",
    )
    engine.add_argument(
        "--preload-adapters",
        type=flag_types.adapter_names,
        default=(),
        metavar="NAME[,NAME...]",
        help="registered adapters read into the host cache at start, before serving, so the first requests "
        "after a restart do not wait on the disk (as many as --adapter-host-cache-gb holds)",
    )
    engine.add_argument(
        "--adapter-eviction",
        choices=("lru", "lfu"),
        default=ENGINE_DEFAULTS.adapter_eviction,
        help="which idle adapter a full tier gives up: least recently or least frequently used (default: %(default)s)",
    )
    engine.add_argument(
        "--num-kv-blocks", type=flag_types.positive_int, help="KV-cache blocks (default: sized from memory)"
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=flag_types.fraction,
        default=ENGINE_DEFAULTS.gpu_memory_utilization,
        help="share of GPU memory the worker may use (default: %(default)s)",
    )
    engine.add_argument(
        "--gpu-memory-fraction",
        type=flag_types.fraction,
        help="hard cap on this process's share of the GPU, for workers sharing one under MPS "
        "(torch's per-process memory fraction; the KV cache is sized within it)",
    )
    plans = worker.add_argument_group('LoRA kernel plans (docs/architecture.md, "Multi-LoRA")')
    plans.add_argument(
        "--kernel-plans-dir",
        type=Path,
        help="LoRA and W8A16 plans tuned on this machine, searched before the packaged ones "
        "(default: STATE_DIR/kernel-plans)",
    )
    plans.add_argument(
        "--kernel-tune-budget-s",
        type=flag_types.seconds,
        default=ENGINE_DEFAULTS.kernel_tune_budget_s,
        help="seconds a model's start may spend tuning the LoRA plans this GPU lacks, and as many for the "
        "W8A16 plans of a model served in fp8; what is left is tuned at the next start; 0: none (default: %(default)s)",
    )
    models = worker.add_argument_group("several base models (switching)")
    models.add_argument(
        "--max-resident-models",
        type=flag_types.positive_int,
        help="base models on the device at once; the others wait warm or cold (default: as many as fit)",
    )
    models.add_argument(
        "--cpu-model-cache-gb",
        type=flag_types.gigabytes,
        default=WORKER_DEFAULTS.cpu_model_cache_bytes / (1 << 30),
        help="pinned host memory for warm checkpoints, least recently used evicted first (default: %(default)s)",
    )
    models.add_argument(
        "--switch-grace",
        type=flag_types.seconds,
        default=WORKER_DEFAULTS.switch_grace_s,
        help="seconds an outgoing model's running jobs get before they are handed back (default: %(default)s)",
    )
    worker.set_defaults(run=commands.worker)
