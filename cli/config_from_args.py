"""Every process's configuration, built from command-line flags here and nowhere else.

Flag values are checked twice over: argparse `type=` functions (cli/flag_types.py) refuse a
malformed value (the message names the flag), and the builders below refuse combinations or missing
settings with a ConfigError naming the flag to fix.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from cli.admin import AdapterRegistration
from cli.devices import visible_gpus
from cli.errors import CommandError
from cli.state import DEFAULT_STATE_DIR, DEMO_FILE, KERNEL_PLANS_DIR, FleetState, read_json
from shared.config import (
    BatchConfig,
    EngineConfig,
    GatewayConfig,
    ModelSpec,
    ReplicaWait,
    TenantLimits,
    WebhookConfig,
    WorkerConfig,
    default_worker_id,
)
from shared.model_info import PACKED_PROJECTIONS
from shared.redis_client import sentinel_url
from shared.tenants import hash_admin_key


class ConfigError(CommandError):
    """A missing or contradictory setting; `flag` is the one to fix. Exits 2, like argparse's own errors."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message, code=flag, exit_code=2)
        self.flag = flag


# where the fleet is: Redis URL, state directory, adapter root


def state_dir(args: argparse.Namespace) -> Path:
    return (args.state_dir or DEFAULT_STATE_DIR).expanduser().resolve()


def _fleet_state(args: argparse.Namespace) -> FleetState | None:
    """The state file of a running `up`: the one in --state-dir, else ./.lorafleet's if there is one."""
    if args.state_dir is None and not FleetState.exists(state_dir(args)):
        return None
    return FleetState.load(state_dir(args))


def _sentinel_url(args: argparse.Namespace) -> str | None:
    """The Sentinel URL of --redis-sentinel and --redis-master-name (given together), None without them."""
    if not args.redis_sentinel and not args.redis_master_name:
        return None
    if not args.redis_sentinel or not args.redis_master_name:
        raise ConfigError("--redis-sentinel", "--redis-sentinel and --redis-master-name go together")
    if args.redis_url:
        raise ConfigError("--redis-url", "give either --redis-url or --redis-sentinel, not both")
    try:
        return sentinel_url(args.redis_sentinel, args.redis_master_name)
    except ValueError as exc:
        raise ConfigError("--redis-sentinel", str(exc)) from None


def redis_url(args: argparse.Namespace) -> str:
    """--redis-sentinel's primary, else --redis-url, else the URL in --state-dir, else $REDIS_URL, else
    the URL of ./.lorafleet."""
    sentinel = _sentinel_url(args)
    if sentinel is not None:
        return sentinel
    if args.redis_url:
        return args.redis_url
    if args.state_dir is not None:
        return FleetState.load(state_dir(args)).redis_url
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    state = _fleet_state(args)
    if state is None:
        raise ConfigError(
            "--redis-url", "give --redis-url or --state-dir (or set REDIS_URL, or run where `lorafleet up` runs)"
        )
    return state.redis_url


def adapter_root(args: argparse.Namespace) -> Path:
    if args.adapter_root is not None:
        return args.adapter_root.expanduser().resolve()
    state = _fleet_state(args)
    if state is None:
        raise ConfigError("--adapter-root", "give --adapter-root or the --state-dir of a running `lorafleet up`")
    return state.adapter_root


# per-process configurations


ADMIN_KEY_ENV = "LORAFLEET_ADMIN_KEY"


def _admin_key(args: argparse.Namespace) -> str | None:
    """The admin key from --admin-key-file, else $LORAFLEET_ADMIN_KEY; None leaves the admin API off."""
    if args.admin_key_file is not None:
        try:
            key = args.admin_key_file.read_text().strip()
        except OSError as exc:
            raise ConfigError("--admin-key-file", f"cannot read {args.admin_key_file}: {exc.strerror}") from exc
        if not key:
            raise ConfigError("--admin-key-file", f"{args.admin_key_file} is empty")
        return key
    return os.environ.get(ADMIN_KEY_ENV) or None


def _gateway_adapter_root(args: argparse.Namespace) -> Path | None:
    """Where adapters registered over HTTP must live: --adapter-root, else a running `up`'s; None refuses them."""
    if args.adapter_root is not None:
        return args.adapter_root.expanduser().resolve()
    state = _fleet_state(args)
    return None if state is None else state.adapter_root


WEBHOOK_SECRET_ENV = "LORAFLEET_WEBHOOK_SECRET"


def _webhooks(args: argparse.Namespace) -> WebhookConfig:
    """Webhooks are on once a host is allowed; they then need a secret (--webhook-secret-file, else the env)."""
    secret = os.environ.get(WEBHOOK_SECRET_ENV) or None
    if args.webhook_secret_file is not None:
        try:
            secret = args.webhook_secret_file.read_text().strip() or None
        except OSError as exc:
            message = f"cannot read {args.webhook_secret_file}: {exc.strerror}"
            raise ConfigError("--webhook-secret-file", message) from exc
    hosts = tuple(args.webhook_allow_host or ())
    if hosts and secret is None:
        raise ConfigError("--webhook-secret-file", f"webhooks need a signing secret (or ${WEBHOOK_SECRET_ENV})")
    return WebhookConfig(allow_hosts=hosts, secret=secret, allow_http=args.webhook_allow_http)


def _replica_wait(args: argparse.Namespace) -> ReplicaWait:
    return ReplicaWait(replicas=args.redis_wait_replicas, timeout_ms=args.redis_wait_timeout_ms)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    admin_key = _admin_key(args)
    return GatewayConfig(
        webhooks=_webhooks(args),
        redis_url=redis_url(args),
        replica_wait=_replica_wait(args),
        host=args.host,
        port=args.port,
        admin_key_sha256=None if admin_key is None else hash_admin_key(admin_key),
        adapter_root=_gateway_adapter_root(args),
        adapter_routing=args.adapter_routing == "on",
        tenant_limits=TenantLimits(
            requests_per_min=args.requests_per_min,
            tokens_per_min=args.tokens_per_min,
            max_concurrent_jobs=args.max_concurrent_jobs,
            max_queue_per_model=args.max_queue_per_model,
        ),
        batches=BatchConfig(
            max_file_bytes=args.max_file_bytes,
            max_file_lines=args.max_file_lines,
            lines_in_flight=args.batch_lines_in_flight,
        ),
    )


def _worker_device(flag_value: str) -> str:
    if flag_value == "auto":
        return "cuda" if visible_gpus() else "cpu"
    if flag_value.startswith("cuda") and not visible_gpus():
        raise ConfigError("--device", f"{flag_value} was asked for, but no GPU is visible")
    return flag_value


def _check_tensor_parallel(size: int, device: str, models: tuple[ModelSpec, ...]) -> None:
    if size == 1:
        return
    if len(models) != 1:
        raise ConfigError("--tensor-parallel", "a tensor-parallel worker serves one --model")
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        if first + size > len(visible_gpus()):
            raise ConfigError(
                "--tensor-parallel", f"{size} ranks from {device} need GPUs up to cuda:{first + size - 1}"
            )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    if args.model:
        models = tuple(args.model)
    else:
        state = _fleet_state(args)
        if state is None:
            raise ConfigError("--model", "give at least one --model NAME=PATH, or the --state-dir of a running `up`")
        models = tuple(ModelSpec(name, path) for name, path in state.models.items())
    _check_unique_names(models)
    root = adapter_root(args)
    if not root.is_dir():
        raise ConfigError("--adapter-root", f"{root} is not a directory")
    if args.preload_adapters and not args.max_loras:
        raise ConfigError("--preload-adapters", "needs LoRA, which --max-loras 0 turns off")
    device = _worker_device(args.device)
    _check_tensor_parallel(args.tensor_parallel, device, models)
    engine = EngineConfig(
        device=device,
        tensor_parallel=args.tensor_parallel,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        int4_decode_copy=args.int4_decode_copy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_grouping_overtakes=args.max_grouping_overtakes,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        adapter_host_cache_gb=args.adapter_host_cache_gb,
        adapter_eviction=args.adapter_eviction,
        kernel_tune_budget_s=args.kernel_tune_budget_s,
    )
    try:
        return WorkerConfig(
            redis_url=redis_url(args),
            models=models,
            adapter_root=root,
            engine=engine,
            worker_id=args.worker_id or default_worker_id(),
            heartbeat_interval_s=args.heartbeat_interval,
            claim_idle_ms=args.claim_idle_ms,
            steal_after_ms=args.steal_after_ms,
            max_deliveries=args.max_deliveries,
            drain_grace_s=args.drain_grace,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            max_resident_models=args.max_resident_models,
            cpu_model_cache_bytes=int(args.cpu_model_cache_gb * (1 << 30)),
            switch_grace_s=args.switch_grace,
            kernel_plans_dir=kernel_plans_dir(args),
            preload_adapters=args.preload_adapters,
            replica_wait=_replica_wait(args),
        )
    except ValueError as exc:
        raise ConfigError("--heartbeat-interval / --claim-idle-ms", str(exc)) from None


def kernel_plans_dir(args: argparse.Namespace) -> Path:
    """--kernel-plans-dir, else the state directory's kernel-plans/."""
    if args.kernel_plans_dir is not None:
        return args.kernel_plans_dir.expanduser().resolve()
    return state_dir(args) / KERNEL_PLANS_DIR


def _check_unique_names(models: tuple[ModelSpec, ...]) -> None:
    names = [spec.name for spec in models]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError("--model", f"model name {repeated[0]!r} is given more than once")


def adapter_registration(args: argparse.Namespace) -> AdapterRegistration:
    return AdapterRegistration(
        name=args.name,
        tenant=args.tenant,
        model=args.model,
        path=args.path,
        adapter_root=adapter_root(args),
        model_path=None if args.model_path is None else args.model_path.expanduser().resolve(),
        max_rank=args.max_lora_rank,
    )


# `up` serves its workers' metrics by default (the gateway's are on its own port); 9200 is clear of
# Prometheus (9090), node-exporter (9100) and DCGM's exporter (9400)
DEFAULT_WORKER_METRICS_PORT = 9200


@dataclass(frozen=True, slots=True)
class UpConfig:
    """What `lorafleet up` starts: Redis (unless `redis_url`), a gateway, and workers."""

    state_dir: Path
    host: str
    port: int
    redis_url: str | None  # None: start an embedded Redis with its data in state_dir/redis
    redis_replicas: int  # with an embedded Redis: replicas (and three Sentinels) beside its primary
    models: tuple[ModelSpec, ...]  # empty: serve the demo model and adapters
    adapter_root: Path
    gpus: tuple[str, ...]  # one worker pinned to each; empty: one CPU worker
    log_level: str
    worker_metrics_port: int  # the first worker's metrics port, the next worker's one above; 0: off

    @property
    def demo(self) -> bool:
        return not self.models

    def worker_metrics_ports(self, num_workers: int) -> list[int]:
        """One metrics port per worker, counting up from `worker_metrics_port`; empty when it is off."""
        if not self.worker_metrics_port:
            return []
        return list(range(self.worker_metrics_port, self.worker_metrics_port + num_workers))


def up_config(args: argparse.Namespace) -> UpConfig:
    models = tuple(args.model or ())
    _check_unique_names(models)
    gpus = visible_gpus() if args.device in ("auto", "cuda") else []
    if args.device == "cuda" and not gpus:
        raise ConfigError("--device", "cuda was asked for, but no GPU is visible")
    directory = state_dir(args)
    given_redis = _sentinel_url(args) or args.redis_url or os.environ.get("REDIS_URL") or None
    if args.redis_replicas and given_redis is not None:
        raise ConfigError("--redis-replicas", "replicas are started beside the Redis `up` starts, not a given one")
    return UpConfig(
        state_dir=directory,
        host=args.host,
        port=args.port,
        redis_url=given_redis,
        redis_replicas=args.redis_replicas,
        models=models,
        adapter_root=(args.adapter_root or directory / "adapters").expanduser().resolve(),
        gpus=tuple(gpus),
        log_level=args.log_level,
        worker_metrics_port=args.worker_metrics_port,
    )


@dataclass(frozen=True, slots=True)
class TuneConfig:
    """What `lorafleet tune` tunes, and where it writes the plans."""

    model: ModelSpec
    max_lora_rank: int
    buckets: tuple[int, ...] | None  # None: a worker's, at the default max_num_batched_tokens
    budget_s: float | None  # None: no limit
    plans_dir: Path | None  # None: the packaged kernels/configs/


def tune_config(args: argparse.Namespace) -> TuneConfig:
    return TuneConfig(
        model=args.model,
        max_lora_rank=args.max_lora_rank,
        buckets=None if args.tokens is None else tuple(sorted(set(args.tokens))),
        budget_s=args.budget_s,
        plans_dir=None if args.packaged else kernel_plans_dir(args),
    )


@dataclass(frozen=True, slots=True)
class QuantizeConfig:
    """What `lorafleet quantize` quantizes, on what text, and where it writes the checkpoint."""

    model: ModelSpec
    format: str  # "int4" (a GPTQ checkpoint) or "fp8" (compressed-tensors)
    out: Path
    calibration: Path  # a UTF-8 text file
    tokens: int  # calibration tokens at most
    window: int  # tokens per calibration sequence
    group_size: int | None  # None: the group --quantization int4 would take
    device: str | None  # None: cuda when torch sees a GPU, else cpu
    unquantized: tuple[str, ...] = ()  # fp8: projections (PEFT names) left in the checkpoint's dtype


def quantize_config(args: argparse.Namespace) -> QuantizeConfig:
    if not args.calibration.is_file():
        raise ConfigError("--calibration", f"{args.calibration} is not a file")
    if args.format == "fp8" and args.group_size is not None:
        raise ConfigError("--group-size", "--group-size is for --format int4: fp8 has a scale per output channel")
    if args.unquantized and args.format != "fp8":
        raise ConfigError("--unquantized", "--unquantized is for --format fp8 (a GPTQ 4-bit checkpoint quantizes all)")
    for pack in PACKED_PROJECTIONS:
        if 0 < len(set(pack) & set(args.unquantized)) < len(pack):
            raise ConfigError("--unquantized", f"{' '.join(pack)} are one GEMM: leave all of them or none unquantized")
    return QuantizeConfig(
        model=args.model,
        format=args.format,
        out=args.out,
        calibration=args.calibration,
        tokens=args.tokens,
        window=args.window,
        group_size=args.group_size,
        device=None if args.device == "auto" else args.device,
        unquantized=tuple(dict.fromkeys(args.unquantized)),
    )


@dataclass(frozen=True, slots=True)
class SubmitTarget:
    gateway_url: str
    api_key: str


def submit_target(args: argparse.Namespace) -> SubmitTarget:
    """--url and --api-key, or what --state-dir's files say for demo tenant --tenant."""
    url, api_key = args.url, args.api_key
    if args.tenant is not None:
        if api_key is not None:
            raise ConfigError("--tenant", "give either --api-key or --tenant (which reads the key from demo.json)")
        tenants = read_json(state_dir(args) / DEMO_FILE).get("tenants", [])
        keys = {entry.get("tenant"): entry.get("api_key") for entry in tenants if isinstance(entry, dict)}
        if args.tenant not in keys:
            raise ConfigError("--tenant", f"{args.tenant!r} is not a demo tenant (known: {', '.join(sorted(keys))})")
        api_key = keys[args.tenant]
    if url is None:
        state = _fleet_state(args)
        if state is None:
            raise ConfigError("--url", "give --url, or the --state-dir of a running `lorafleet up`")
        url = state.gateway_url
    if api_key is None:
        raise ConfigError("--api-key", "give --api-key, or --tenant with the --state-dir of a demo `lorafleet up`")
    return SubmitTarget(gateway_url=url.rstrip("/"), api_key=api_key)
