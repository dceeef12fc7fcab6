"""`lorafleet`: the command-line parser and the dispatch to each command.

Commands import their heavy dependencies (torch through the worker, aiohttp through the gateway)
only when they run, so `lorafleet --help` and the admin commands start fast. Only the long-running
processes (up, gateway, worker) configure logging; the admin commands and submit just print.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from cli import config_from_args as cfa
from cli.errors import CommandError
from cli.redis_server import RedisServerError
from cli.state import DEFAULT_STATE_DIR
from shared.config import EngineConfig, GatewayConfig, WorkerConfig
from shared.errors import LorafleetError
from shared.log import configure_logging

_ENGINE = EngineConfig()
_GATEWAY = GatewayConfig(redis_url="")
_WORKER = WorkerConfig(redis_url="", models=(), adapter_root=Path())


def _add_redis_flags(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the fleet is")
    where.add_argument("--redis-url", help="Redis of the fleet (default: from --state-dir, else $REDIS_URL)")
    _add_sentinel_flags(where)
    where.add_argument(
        "--state-dir", type=Path, help=f"state dir of a running `lorafleet up` (default: {DEFAULT_STATE_DIR})"
    )


def _add_sentinel_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--redis-sentinel", metavar="HOST:PORT[,HOST:PORT...]", help="reach the Redis primary through these Sentinels"
    )
    group.add_argument("--redis-master-name", help="the primary's name in the Sentinels (with --redis-sentinel)")


def _add_replica_wait_flags(parser: argparse.ArgumentParser) -> None:
    durable = parser.add_argument_group("durable writes (Redis with replicas)")
    durable.add_argument(
        "--redis-wait-replicas",
        type=cfa.count,
        default=_GATEWAY.replica_wait.replicas,
        help="replicas that must confirm a new job or a result (Redis WAIT); 0: no wait (default: %(default)s)",
    )
    durable.add_argument(
        "--redis-wait-timeout-ms",
        type=cfa.positive_int,
        default=_GATEWAY.replica_wait.timeout_ms,
        help="longest wait for that confirmation; a job unconfirmed by then is withdrawn, 503 (default: %(default)s)",
    )


def _add_up(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="run Redis, the gateway and workers on this machine (the demo without --model)")
    up.add_argument("--host", default=_GATEWAY.host, help="gateway bind address (default: %(default)s)")
    up.add_argument("--port", type=cfa.port_number, default=_GATEWAY.port, help="gateway port (default: %(default)s)")
    up.add_argument(
        "--state-dir",
        type=Path,
        help=f"Redis data, generated demo files, lorafleet.json (default: {DEFAULT_STATE_DIR})",
    )
    up.add_argument("--redis-url", help="use this Redis instead of starting one (default: $REDIS_URL)")
    _add_sentinel_flags(up.add_argument_group("a Redis watched by Sentinels, instead of starting one"))
    up.add_argument(
        "--redis-replicas",
        type=cfa.count,
        default=0,
        help="start a primary, this many replicas and three Sentinels; jobs wait for one replica (default: 0)",
    )
    up.add_argument(
        "--model", type=cfa.model_spec, action="append", metavar="NAME=PATH", help="HF model dir to serve (repeatable)"
    )
    up.add_argument("--adapter-root", type=Path, help="adapters live under here (default: STATE_DIR/adapters)")
    up.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="one worker per GPU, or one on CPU"
    )
    up.add_argument(
        "--worker-metrics-port",
        type=cfa.port_or_off,
        default=cfa.DEFAULT_WORKER_METRICS_PORT,
        help="Prometheus metrics of the first worker (the next ones count up); 0: off (default: %(default)s)",
    )
    up.set_defaults(run=_run_up)


def _add_gateway(commands: argparse._SubParsersAction) -> None:
    gateway = commands.add_parser("gateway", help="run one gateway process (HTTP API)")
    _add_redis_flags(gateway)
    _add_replica_wait_flags(gateway)
    gateway.add_argument("--host", default=_GATEWAY.host, help="bind address (default: %(default)s)")
    gateway.add_argument("--port", type=cfa.port_number, default=_GATEWAY.port, help="port (default: %(default)s)")
    gateway.add_argument(
        "--admin-key-file",
        type=Path,
        help=f"file holding the admin API key (default: ${cfa.ADMIN_KEY_ENV}; neither: the admin API is off)",
    )
    gateway.add_argument(
        "--adapter-root", type=Path, help="adapters registered over HTTP must live here (default: from --state-dir)"
    )
    gateway.add_argument(
        "--adapter-routing",
        choices=("on", "off"),
        default="on" if _GATEWAY.adapter_routing else "off",
        help="place adapter jobs on the worker holding the adapter; off: any worker takes any job "
        "(default: %(default)s)",
    )
    limits = gateway.add_argument_group("per-tenant admission limits (a tenant's own limits, set by an admin, win)")
    for flag, default in (
        ("--requests-per-min", _GATEWAY.tenant_limits.requests_per_min),
        ("--tokens-per-min", _GATEWAY.tenant_limits.tokens_per_min),
        ("--max-concurrent-jobs", _GATEWAY.tenant_limits.max_concurrent_jobs),
        ("--max-queue-per-model", _GATEWAY.tenant_limits.max_queue_per_model),
    ):
        limits.add_argument(flag, type=cfa.positive_int, default=default, help="(default: %(default)s)")
    batches = gateway.add_argument_group("files and batches (the OpenAI Files and Batch APIs; files live in Redis)")
    for flag, default, what in (
        ("--max-file-bytes", _GATEWAY.batches.max_file_bytes, "largest file upload"),
        ("--max-file-lines", _GATEWAY.batches.max_file_lines, "most requests in a batch input file"),
        ("--batch-lines-in-flight", _GATEWAY.batches.lines_in_flight, "lines of one batch queued or running at once"),
    ):
        batches.add_argument(flag, type=cfa.positive_int, default=default, help=f"{what} (default: %(default)s)")
    webhooks = gateway.add_argument_group("job webhooks (off unless a host is allowed)")
    webhooks.add_argument(
        "--webhook-allow-host",
        action="append",
        metavar="HOST",
        help="a host job webhooks may call; *.example.com allows its subdomains (repeatable)",
    )
    webhooks.add_argument(
        "--webhook-secret-file",
        type=Path,
        help=f"file holding the secret webhook signatures derive from (default: ${cfa.WEBHOOK_SECRET_ENV})",
    )
    webhooks.add_argument(
        "--webhook-allow-http", action="store_true", help="allow plain-http webhook URLs (default: https only)"
    )
    gateway.set_defaults(run=_run_gateway)


def _add_worker(commands: argparse._SubParsersAction) -> None:
    worker = commands.add_parser("worker", help="run one worker process (one GPU, or the CPU)")
    _add_redis_flags(worker)
    _add_replica_wait_flags(worker)
    worker.add_argument(
        "--model", type=cfa.model_spec, action="append", metavar="NAME=PATH", help="model to serve (repeatable)"
    )
    worker.add_argument("--adapter-root", type=Path, help="adapter paths are relative to this")
    worker.add_argument(
        "--device",
        type=cfa.device_name,
        default="auto",
        help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)",
    )
    worker.add_argument("--worker-id", help="name in heartbeats and job records (default: HOST-PID)")
    delivery = worker.add_argument_group("delivery")
    delivery.add_argument(
        "--heartbeat-interval",
        type=cfa.seconds,
        default=_WORKER.heartbeat_interval_s,
        help="seconds between heartbeats, which also renew the claim on running jobs (default: %(default)s)",
    )
    delivery.add_argument(
        "--claim-idle-ms",
        type=cfa.positive_int,
        default=_WORKER.claim_idle_ms,
        help="a running job not renewed for this long is taken over by another worker (default: %(default)s)",
    )
    delivery.add_argument(
        "--steal-after-ms",
        type=cfa.positive_int,
        default=_WORKER.steal_after_ms,
        help="a job routed to another worker that waited there unread this long is taken by a worker with "
        "free batch slots (default: %(default)s)",
    )
    delivery.add_argument(
        "--max-deliveries",
        type=cfa.positive_int,
        default=_WORKER.max_deliveries,
        help="a job started more often than this is failed and dead-lettered (default: %(default)s)",
    )
    delivery.add_argument(
        "--drain-grace",
        type=cfa.seconds,
        default=_WORKER.drain_grace_s,
        help="on SIGTERM, seconds running jobs get to finish before they are handed back (default: %(default)s)",
    )
    metrics = worker.add_argument_group("Prometheus metrics")
    metrics.add_argument(
        "--metrics-port",
        type=cfa.port_or_off,
        default=_WORKER.metrics_port,
        help="serve the worker's metrics over HTTP on this port; 0: off (default: %(default)s)",
    )
    metrics.add_argument(
        "--metrics-host", default=_WORKER.metrics_host, help="bind address of the metrics port (default: %(default)s)"
    )
    engine = worker.add_argument_group("engine sizes")
    engine.add_argument(
        "--tensor-parallel",
        type=cfa.positive_int,
        default=_ENGINE.tensor_parallel,
        help="split one model over this many GPUs (from --device's on), one process each; this process is "
        "rank 0 and starts the others (default: %(default)s)",
    )
    engine.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), help="weights' dtype (default: the checkpoint's)"
    )
    engine.add_argument(
        "--quantization",
        choices=("fp8", "int4"),
        help="quantize the base weights at load: fp8 = W8A8, per-channel weight and per-token activation scales; "
        "int4 = W4A16, 4-bit weights in groups of 128 with a scale and zero point each; "
        "FP8, AWQ and GPTQ checkpoints load as they are (default: as the checkpoint holds them)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default=_ENGINE.kv_cache_dtype,
        help="the KV cache's dtype; fp8 holds about twice the blocks (default: %(default)s, the activations')",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=cfa.positive_int,
        default=_ENGINE.max_num_seqs,
        help="sequences in the running batch (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=cfa.positive_int,
        default=_ENGINE.max_num_batched_tokens,
        help="tokens one engine step may process (default: %(default)s)",
    )
    engine.add_argument(
        "--max-loras",
        type=cfa.count,
        default=_ENGINE.max_loras,
        help="the device's LoRA pool, in adapters of --max-lora-rank; it is paged by 16 ranks, so more adapters "
        "of lower rank fit. 0: LoRA off (no LoRA memory, jobs naming an adapter refused) (default: %(default)s)",
    )
    engine.add_argument(
        "--max-lora-rank", type=cfa.positive_int, default=_ENGINE.max_lora_rank, help="(default: %(default)s)"
    )
    engine.add_argument(
        "--adapter-host-cache-gb",
        type=cfa.gigabytes,
        help="pinned host memory for adapters read from disk, at least the device pool's --max-loras max-rank "
        "adapters (default: twice that)",
    )
    engine.add_argument(
        "--preload-adapters",
        type=cfa.adapter_names,
        default=(),
        metavar="NAME[,NAME...]",
        help="registered adapters read into the host cache at start, before serving, so the first requests "
        "after a restart do not wait on the disk (as many as --adapter-host-cache-gb holds)",
    )
    engine.add_argument(
        "--adapter-eviction",
        choices=("lru", "lfu"),
        default=_ENGINE.adapter_eviction,
        help="which idle adapter a full tier gives up: least recently or least frequently used (default: %(default)s)",
    )
    engine.add_argument("--num-kv-blocks", type=cfa.positive_int, help="KV-cache blocks (default: sized from memory)")
    engine.add_argument(
        "--gpu-memory-utilization",
        type=cfa.fraction,
        default=_ENGINE.gpu_memory_utilization,
        help="share of GPU memory the worker may use (default: %(default)s)",
    )
    engine.add_argument(
        "--gpu-memory-fraction",
        type=cfa.fraction,
        help="hard cap on this process's share of the GPU, for workers sharing one under MPS "
        "(torch's per-process memory fraction; the KV cache is sized within it)",
    )
    plans = worker.add_argument_group('LoRA kernel plans (docs/architecture.md, "Multi-LoRA")')
    plans.add_argument(
        "--kernel-plans-dir",
        type=Path,
        help="LoRA plans tuned on this machine, searched before the packaged ones (default: STATE_DIR/kernel-plans)",
    )
    plans.add_argument(
        "--kernel-tune-budget-s",
        type=cfa.seconds,
        default=_ENGINE.kernel_tune_budget_s,
        help="seconds a model's start may spend tuning the LoRA plans this GPU lacks; what is left is tuned "
        "at the next start; 0: none (default: %(default)s)",
    )
    models = worker.add_argument_group("several base models (switching)")
    models.add_argument(
        "--max-resident-models",
        type=cfa.positive_int,
        help="base models on the device at once; the others wait warm or cold (default: as many as fit)",
    )
    models.add_argument(
        "--cpu-model-cache-gb",
        type=cfa.gigabytes,
        default=_WORKER.cpu_model_cache_bytes / (1 << 30),
        help="pinned host memory for warm checkpoints, least recently used evicted first (default: %(default)s)",
    )
    models.add_argument(
        "--switch-grace",
        type=cfa.seconds,
        default=_WORKER.switch_grace_s,
        help="seconds an outgoing model's running jobs get before they are handed back (default: %(default)s)",
    )
    worker.set_defaults(run=_run_worker)


def _add_admin(commands: argparse._SubParsersAction) -> None:
    tenant = commands.add_parser("tenant", help="manage tenants").add_subparsers(dest="action", required=True)
    create = tenant.add_parser("create", help="create a tenant and print its API key (shown once)")
    create.add_argument("name")
    _add_redis_flags(create)
    create.add_argument("--json", action="store_true", help='print {"tenant", "api_key"}')
    create.set_defaults(run=_run_tenant_create)

    adapter = commands.add_parser("adapter", help="manage adapters").add_subparsers(dest="action", required=True)
    register = adapter.add_parser("register", help="validate a PEFT LoRA adapter directory and register it")
    register.add_argument("name", help="the adapter's name in job requests")
    register.add_argument("--tenant", required=True, help="owning tenant, or 'shared' for every tenant")
    register.add_argument("--model", required=True, help="base model name")
    register.add_argument("--path", required=True, help="adapter dir under the tenant's directory, e.g. acme/support")
    register.add_argument("--adapter-root", type=Path, help="default: the running `up`'s")
    register.add_argument("--model-path", type=Path, help="the model's HF dir, if no worker has published it yet")
    register.add_argument(
        "--max-lora-rank",
        type=cfa.positive_int,
        default=_ENGINE.max_lora_rank,
        help="refuse larger ranks (default: %(default)s)",
    )
    _add_redis_flags(register)
    register.add_argument("--json", action="store_true", help="print the adapter record")
    register.set_defaults(run=_run_adapter_register)

    alias = commands.add_parser("alias", help="manage adapter aliases (canaries, rollouts, rollbacks)")
    alias_actions = alias.add_subparsers(dest="action", required=True)
    alias_set = alias_actions.add_parser(
        "set", help="point an alias at weighted adapters; jobs submitted from now on draw by the new weights"
    )
    alias_set.add_argument("name", help="the alias's name in job requests")
    alias_set.add_argument("--tenant", required=True, help="owning tenant, or 'shared' for every tenant")
    alias_set.add_argument(
        "--adapter",
        dest="versions",
        action="append",
        required=True,
        type=cfa.alias_version,
        metavar="ADAPTER=WEIGHT",
        help="a registered adapter and its weight (repeat: e.g. support-v2=95 support-v3=5; 0 keeps it listed, unused)",
    )
    _add_redis_flags(alias_set)
    alias_set.add_argument("--json", action="store_true", help="print the alias")
    alias_set.set_defaults(run=_run_alias_set)
    alias_list = alias_actions.add_parser("list", help="every alias with its weights")
    _add_redis_flags(alias_list)
    alias_list.set_defaults(run=_run_alias_list)
    alias_delete = alias_actions.add_parser("delete", help="remove an alias (jobs queued keep their adapter)")
    alias_delete.add_argument("name")
    _add_redis_flags(alias_delete)
    alias_delete.set_defaults(run=_run_alias_delete)


def _add_submit(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser("submit", help="run one prompt through the gateway and print the output")
    submit.add_argument("prompt")
    submit.add_argument("--url", help="gateway URL (default: the running `up`'s)")
    submit.add_argument("--api-key", help="tenant API key")
    submit.add_argument("--state-dir", type=Path, help=f"a running `up`'s state dir (default: {DEFAULT_STATE_DIR})")
    submit.add_argument("--tenant", help="demo tenant whose key to take from STATE_DIR/demo.json")
    submit.add_argument("--model", required=True)
    submit.add_argument("--adapter")
    submit.add_argument("--max-tokens", type=cfa.positive_int)
    submit.add_argument("--temperature", type=float)
    submit.add_argument("--seed", type=int)
    submit.add_argument(
        "--timeout", type=float, default=300.0, help="give up waiting after this many seconds (default: %(default)s)"
    )
    submit.add_argument("--json", action="store_true", help="print the whole job record")
    submit.set_defaults(run=_run_submit)


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    """Which gateway, as which tenant (as `submit` takes them)."""
    parser.add_argument("--url", help="gateway URL (default: the running `up`'s)")
    parser.add_argument("--api-key", help="tenant API key")
    parser.add_argument("--state-dir", type=Path, help=f"a running `up`'s state dir (default: {DEFAULT_STATE_DIR})")
    parser.add_argument("--tenant", help="demo tenant whose key to take from STATE_DIR/demo.json")


def _add_batch(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser("batch", help="run a JSONL file of requests as a batch (the OpenAI Batch API)")
    actions = batch.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="upload FILE, start its batch, follow it with a progress bar")
    submit.add_argument("file", type=Path, help="JSONL: OpenAI batch lines, or request bodies (prompt or messages)")
    submit.add_argument("--model", required=True)
    submit.add_argument("--adapter", help="run every line with this adapter")
    submit.add_argument("--no-wait", action="store_true", help="print the batch id and return at once")
    submit.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds to follow it (default: 24 h)")
    _add_target_flags(submit)
    submit.set_defaults(run=_run_batch_submit)
    get = actions.add_parser("get", help="write a finished batch's output lines to --output")
    get.add_argument("batch_id")
    get.add_argument("--output", type=Path, required=True, help="where the output JSONL goes")
    get.add_argument("--errors", type=Path, help="where the error JSONL goes (default: not written)")
    _add_target_flags(get)
    get.set_defaults(run=_run_batch_get)


def _add_tune(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser(
        "tune",
        help="tune the LoRA kernels' plans for a model's shapes on this machine's GPU",
        description="Time the multi-LoRA kernels at the model's projection shapes on this machine's GPU and "
        "write the fastest plan per token bucket where workers look them up (kernels/lora/tuning/tuner.py "
        "describes the tuner). Every bucket asked for is tuned again, whatever the tables hold.",
    )
    tune.add_argument("--model", type=cfa.model_spec, required=True, metavar="NAME=PATH", help="HF model dir")
    tune.add_argument(
        "--max-lora-rank",
        type=cfa.positive_int,
        default=_ENGINE.max_lora_rank,
        help="the workers' --max-lora-rank, whose padding keys the plans (default: %(default)s)",
    )
    tune.add_argument(
        "--tokens",
        type=cfa.positive_int,
        nargs="+",
        help="token buckets (default: those a worker with the default --max-num-batched-tokens tunes)",
    )
    tune.add_argument("--budget-s", type=cfa.seconds, help="stop after this many seconds (default: no limit)")
    where = tune.add_mutually_exclusive_group()
    where.add_argument("--kernel-plans-dir", type=Path, help="write here (default: STATE_DIR/kernel-plans)")
    where.add_argument("--state-dir", type=Path, help=f"write into its kernel-plans/ (default: {DEFAULT_STATE_DIR})")
    where.add_argument(
        "--packaged", action="store_true", help="write the packaged table, kernels/configs/<GPU>.json, to commit it"
    )
    tune.set_defaults(run=_run_tune)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="Multi-tenant LoRA serving.")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_up, _add_gateway, _add_worker, _add_admin, _add_submit, _add_batch, _add_tune):
        add(commands)
    return parser


def _run_up(args: argparse.Namespace) -> int:
    from cli.up import run_up

    configure_logging("up", level=args.log_level)
    return run_up(cfa.up_config(args))


def _run_gateway(args: argparse.Namespace) -> int:
    from gateway.main import run_gateway

    configure_logging("gateway", level=args.log_level, batched=True)
    run_gateway(cfa.gateway_config(args))
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    from worker.main import run_worker
    from worker.memory_plan import MemoryPlanError

    configure_logging("worker", level=args.log_level)
    try:
        return run_worker(cfa.worker_config(args))
    except MemoryPlanError as exc:  # a configuration the device cannot hold: the message names the settings
        raise CommandError(str(exc), exit_code=2) from exc


def _run_tune(args: argparse.Namespace) -> int:
    from cli.tune import run_tune

    return run_tune(cfa.tune_config(args))


def _run_tenant_create(args: argparse.Namespace) -> int:
    from cli.admin import tenant_create

    return tenant_create(cfa.redis_url(args), args.name, as_json=args.json)


def _run_adapter_register(args: argparse.Namespace) -> int:
    from cli.admin import adapter_register

    return adapter_register(cfa.redis_url(args), cfa.adapter_registration(args), as_json=args.json)


def _run_alias_set(args: argparse.Namespace) -> int:
    from cli.admin import alias_set

    return alias_set(cfa.redis_url(args), args.name, args.tenant, args.versions, as_json=args.json)


def _run_alias_list(args: argparse.Namespace) -> int:
    from cli.admin import alias_list

    return alias_list(cfa.redis_url(args))


def _run_alias_delete(args: argparse.Namespace) -> int:
    from cli.admin import alias_delete

    return alias_delete(cfa.redis_url(args), args.name)


def _run_submit(args: argparse.Namespace) -> int:
    from cli.submit import submit

    body = {
        name: value
        for name, value in (
            ("model", args.model),
            ("adapter", args.adapter),
            ("prompt", args.prompt),
            ("max_tokens", args.max_tokens),
            ("temperature", args.temperature),
            ("seed", args.seed),
        )
        if value is not None
    }
    return submit(cfa.submit_target(args), body, timeout_s=args.timeout, as_json=args.json)


def _run_batch_submit(args: argparse.Namespace) -> int:
    from cli.batch import submit_batch

    model = args.model if args.adapter is None else f"{args.model}:{args.adapter}"
    return submit_batch(cfa.submit_target(args), args.file, model, wait=not args.no_wait, timeout_s=args.timeout)


def _run_batch_get(args: argparse.Namespace) -> int:
    from cli.batch import get_batch

    return get_batch(cfa.submit_target(args), args.batch_id, args.output, args.errors)


def _fail(message: str, exit_code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except CommandError as exc:
        return _fail(str(exc), exc.exit_code)
    except LorafleetError as exc:
        return _fail(f"{exc.code}: {exc.message}", 2)
    except RedisServerError as exc:
        return _fail(f"redis-server: {exc}", 1)
    except redis.RedisError as exc:
        return _fail(f"redis: {exc}", 1)
    except KeyboardInterrupt:
        return 130
