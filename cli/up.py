"""`lorafleet up`: the whole fleet on one machine, supervised.

Starts what is missing: a Redis server (unless given a URL; with `--redis-replicas N` a primary, N
replicas and three Sentinels, cli/redis_ha.py, and every new job waits for a replica), the gateway, and one worker per
visible GPU (or one CPU worker), each a `python -m cli ...` child. Without `--model` it first
generates and provisions the demo. It prints "ready" once the gateway answers /readyz and every
model has been published by a worker; then it watches: SIGINT / SIGTERM stop everything (exit 0);
a child that dies before "ready" stops everything (exit 1), one that dies later is restarted with
backoff (cli/supervisor.py) and the log says so. Redis is stopped last; the embedded Redis dying
stops everything.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis
import structlog

import cli
from cli.banner import startup_banner
from cli.config_from_args import ConfigError, UpConfig
from cli.demo import DemoTenant, ensure_demo_files, provision_demo
from cli.embedded_redis import port_is_free, start_embedded_redis
from cli.errors import CommandError
from cli.redis_ha import start_redis_ha
from cli.state import KERNEL_PLANS_DIR, FleetState, ensure_admin_key
from cli.supervisor import Supervisor
from shared import keys
from shared.config import DEFAULT_DRAIN_GRACE_S, ModelSpec
from shared.redis_client import plain_redis, sync_redis

log = structlog.get_logger(__name__)

# A worker drains for DEFAULT_DRAIN_GRACE_S after SIGTERM (finishing its running jobs, handing
# the rest back); the supervisor waits a little longer before SIGKILL so a Ctrl-C is a clean drain.
STOP_GRACE_S = DEFAULT_DRAIN_GRACE_S + 10.0
_POLL_S = 0.25
_WAITING_LOG_EVERY_S = 10.0
_REDIS_MISSED_PINGS = 3  # consecutive failures before the embedded Redis counts as dead
# with replicas, a primary's death is a failover of a few seconds (cli/redis_ha.py), not the fleet's end
_HA_MISSED_PINGS = 80

# readiness is checked on this machine, never through an HTTP proxy from the environment
_local_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@contextmanager
def _exclusive(state_dir: Path) -> Iterator[None]:
    """Hold the state directory's lock: two `up`s on one directory would share (and corrupt) its Redis data."""
    with (state_dir / "up.lock").open("w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CommandError(f"another `lorafleet up` is running with the state dir {state_dir}") from None
        yield


def _local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server (the gateway, a worker's metrics) bound to `host`."""
    connect = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


def _child_env(cuda_visible_devices: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # run from a source checkout that is not installed, a child must still import this same tree
    source_root = Path(cli.__file__).resolve().parent.parent
    if (source_root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source_root), env.get("PYTHONPATH")]))
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def _answers_ok(url: str) -> bool:
    try:
        with _local_http.open(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError (a 503) is a URLError
        return False


class _Fleet:
    """One run of `up` once Redis is reachable: provision, start children, wait for ready, watch."""

    def __init__(self, config: UpConfig, supervisor: Supervisor, redis_url: str, *, embedded: bool) -> None:
        self.config = config
        self.supervisor = supervisor
        self.redis_url = redis_url
        self.embedded = embedded
        self.gateway_url = _local_url(config.host, config.port)
        self.redis = sync_redis(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._missed_pings = 0

    def run(self) -> int:
        try:
            self.redis.ping()
        except redis.RedisError as exc:
            raise CommandError(f"cannot reach Redis at {self.redis_url}: {exc}") from exc
        self.config.adapter_root.mkdir(parents=True, exist_ok=True)
        models = self.config.models
        tenants: list[DemoTenant] = []
        if self.config.demo:
            models = (ensure_demo_files(self.config.state_dir, self.config.adapter_root),)
            tenants = asyncio.run(self._provision_demo(models[0]))
        if self.embedded:
            self._forget_models(models)
        FleetState(
            redis_url=self.redis_url,
            models={spec.name: spec.path for spec in models},
            adapter_root=self.config.adapter_root,
            gateway_url=self.gateway_url,
        ).save(self.config.state_dir)
        if self.supervisor.stop_requested:
            return 0
        workers = self._start_children(models)
        metrics_urls = [
            f"{_local_url(self.config.host, port)}/metrics" for port in self.config.worker_metrics_ports(len(workers))
        ]
        print(
            startup_banner(
                gateway_url=self.gateway_url,
                redis_url=self.redis_url,
                embedded_redis=self.embedded,
                state_dir=self.config.state_dir,
                models=models,
                workers=workers,
                worker_metrics=metrics_urls,
                demo_tenants=tenants,
            ),
            flush=True,
        )
        started = time.monotonic()
        if not self._wait_until_ready(models):
            return self._stop_requested()
        print(f"\nready in {time.monotonic() - started:.1f}s: press Ctrl-C to stop", flush=True)
        log.info("ready", gateway=self.gateway_url)
        while not self.supervisor.wait(_POLL_S):
            self.supervisor.restart_exited()
            self._check_redis()
        return self._stop_requested()

    def close(self) -> None:
        self.redis.close()

    async def _provision_demo(self, model: ModelSpec) -> list[DemoTenant]:
        async with plain_redis(self.redis_url) as client:
            return await provision_demo(client, self.config.state_dir, self.config.adapter_root, model)

    def _forget_models(self, models: tuple[ModelSpec, ...]) -> None:
        """Drop model records the previous run left in our own Redis, so "ready" waits for this run's workers
        (nothing else can be serving them: this Redis was just started and listens on loopback only)."""
        for spec in models:
            self.redis.delete(keys.model(spec.name))
            self.redis.srem(keys.MODELS, spec.name)

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli", "--log-level", self.config.log_level, *args]

    def _start_children(self, models: tuple[ModelSpec, ...]) -> list[str]:
        """Start the gateway and the workers; returns the workers' names."""
        config = self.config
        gateway = ["gateway", "--redis-url", self.redis_url, "--host", config.host, "--port", str(config.port)]
        gateway += ["--admin-key-file", str(ensure_admin_key(config.state_dir))]
        gateway += ["--adapter-root", str(config.adapter_root)]
        # with replicas of its own, a job is accepted (and a result counts) once one of them has it
        durable = ["--redis-wait-replicas", "1"] if config.redis_replicas else []
        gateway += durable
        self.supervisor.start("gateway", self._cli(*gateway), _child_env(None))
        worker = ["worker", "--redis-url", self.redis_url, "--adapter-root", str(config.adapter_root), *durable]
        worker += [arg for spec in models for arg in ("--model", f"{spec.name}={spec.path}")]
        worker += ["--metrics-host", config.host, "--kernel-plans-dir", str(config.state_dir / KERNEL_PLANS_DIR)]
        # (name, device flags, CUDA_VISIBLE_DEVICES): one per GPU, or one CPU worker with every GPU hidden.
        # The demo's checkpoint is float32 (exact on a CPU, where bfloat16 matmuls are slow); GPUs serve it in
        # bfloat16, as they would any model.
        gpu_flags = ["--device", "cuda", *(["--dtype", "bfloat16"] if config.demo else [])]
        placements = [(f"worker-gpu{gpu}", gpu_flags, gpu) for gpu in config.gpus] or [
            ("worker-cpu", ["--device", "cpu"], "")
        ]
        ports = config.worker_metrics_ports(len(placements)) or [0] * len(placements)
        return [
            self.supervisor.start(
                name, self._cli(*worker, *device_flags, "--metrics-port", str(port)), _child_env(visible)
            ).name
            for (name, device_flags, visible), port in zip(placements, ports, strict=True)
        ]

    def _check_alive(self) -> None:
        """Raise CommandError when a child has exited (before "ready") or the embedded Redis stopped answering."""
        child = self.supervisor.first_exited()
        if child is not None:
            log.error("child_exited", child=child.name, exit_code=child.exit_code)
            raise CommandError(f"{child.name} exited unexpectedly with code {child.exit_code}")
        self._check_redis()

    def _check_redis(self) -> None:
        """Raise CommandError when the embedded Redis stopped answering."""
        if not self.embedded:
            return
        try:
            self.redis.ping()
            self._missed_pings = 0
        except redis.RedisError as exc:
            self._missed_pings += 1
            if self._missed_pings >= (_HA_MISSED_PINGS if self.config.redis_replicas else _REDIS_MISSED_PINGS):
                log.error("redis_down", url=self.redis_url, error=str(exc))
                raise CommandError(
                    f"the embedded Redis stopped answering; see {self.config.state_dir / 'redis' / 'redis.log'}"
                ) from exc

    def _wait_until_ready(self, models: tuple[ModelSpec, ...]) -> bool:
        """Poll until the gateway is ready and every model is published; False if a stop came first."""
        pending = {"gateway", *(f"model {spec.name}" for spec in models)}
        last_report = time.monotonic()
        while True:
            self._check_alive()
            if "gateway" in pending and _answers_ok(f"{self.gateway_url}/readyz"):
                pending.discard("gateway")
            for spec in models:
                if f"model {spec.name}" in pending and self.redis.exists(keys.model(spec.name)):
                    pending.discard(f"model {spec.name}")
            if not pending:
                return True
            if time.monotonic() - last_report > _WAITING_LOG_EVERY_S:
                log.info("waiting", pending=sorted(pending))
                last_report = time.monotonic()
            if self.supervisor.wait(_POLL_S):
                return False

    def _stop_requested(self) -> int:
        print("stopping (Ctrl-C again to kill at once)", flush=True)
        return 0


def run_up(config: UpConfig) -> int:
    """Run the fleet until a signal (returns 0) or a failure (raises CommandError, ConfigError, LorafleetError).
    Whatever was started is stopped on the way out, children first and Redis last."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor()
    with ExitStack() as cleanup:
        cleanup.enter_context(_exclusive(config.state_dir))
        cleanup.enter_context(supervisor.signals_handled())
        if not port_is_free(config.host, config.port):
            raise ConfigError("--port", f"{config.host}:{config.port} is already in use")
        for port in config.worker_metrics_ports(max(1, len(config.gpus))):
            if not port_is_free(config.host, port):
                raise ConfigError("--worker-metrics-port", f"{config.host}:{port} is already in use (0 turns it off)")
        cleanup.callback(log.info, "stopped")
        redis_url = config.redis_url
        if redis_url is None:
            redis_server = (
                start_redis_ha(config.state_dir, config.redis_replicas)
                if config.redis_replicas
                else start_embedded_redis(config.state_dir)
            )
            cleanup.callback(redis_server.stop)
            redis_url = redis_server.url
        fleet = _Fleet(config, supervisor, redis_url, embedded=config.redis_url is None)
        cleanup.callback(fleet.close)
        cleanup.callback(supervisor.stop_all, STOP_GRACE_S)
        return fleet.run()
