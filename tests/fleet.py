"""A fleet of real processes for end-to-end and fault-injection tests: gateway and CPU workers
(`python -m cli`) over a real Redis, the demo model and adapters, and the checks fault tests end with."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis

from cli.demo_adapters import DEMO_ADAPTERS, write_demo_adapter
from cli.demo_model import DemoModelShape, write_demo_model
from cli.redis_server import free_port
from shared import keys
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.redis_client import plain_redis, sync_redis
from shared.schema import PRIORITIES, JobRecord, JobStatus
from shared.tenants import create_tenant
from tests.e2e.processes import start_lorafleet, stop_processes, wait_until

MODEL = "demo"
TENANT = DEMO_ADAPTERS[0].tenant
# fast failure detection for tests: a dead worker's jobs are taken over after 1.5 s. A live worker's are too
# whenever its claims are not renewed for that long: an entry read and not yet started (only running ones are
# renewed), or a whole loaded machine stalling (2 shared cores: gateway, workers and Redis all silent for 3 s).
# Such a take-over is an ordinary delivery, counted in the job's attempts: `redeliveries` finds them.
HEARTBEAT_S = 0.3
CLAIM_IDLE_MS = 1500
# fault tests submit bursts of 100 jobs as one tenant: admission limits must not be what they measure
GATEWAY_FLAGS = ["--max-concurrent-jobs", "1000", "--requests-per-min", "100000"]
WORKER_FLAGS = [
    "--device", "cpu", "--max-loras", "2", "--max-num-seqs", "8",
    "--heartbeat-interval", str(HEARTBEAT_S), "--claim-idle-ms", str(CLAIM_IDLE_MS),
]  # fmt: skip


def write_demo_assets(root: Path, shape: DemoModelShape | None = None) -> tuple[Path, Path]:
    """(model dir, adapter root) under `root`: the demo model (of `shape`; None: the demo's own) and its
    tenants' adapters, as `lorafleet up` writes them."""
    model_dir, adapter_root = root / "model", root / "adapters"
    model_dir.mkdir(parents=True)
    write_demo_model(model_dir, shape or DemoModelShape())
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    for adapter in DEMO_ADAPTERS:
        (adapter_root / adapter.path(MODEL)).mkdir(parents=True)
        write_demo_adapter(adapter_root / adapter.path(MODEL), adapter, info, model_dir)
    return model_dir, adapter_root


def provision(redis_url: str, model_dir: Path, adapter_root: Path) -> dict[str, str]:
    """Register the demo tenants and their adapters; returns tenant → API key."""
    info = ModelInfo.from_pretrained(MODEL, model_dir)

    async def run() -> dict[str, str]:
        async with plain_redis(redis_url) as client:
            api_keys = {}
            for adapter in DEMO_ADAPTERS:
                api_keys[adapter.tenant] = await create_tenant(client, adapter.tenant)
                await register_adapter(
                    client,
                    name=adapter.name,
                    tenant=adapter.tenant,
                    model=info,
                    adapter_root=adapter_root,
                    path=adapter.path(MODEL),
                    max_rank=64,
                    max_bytes=1 << 30,
                )
            return api_keys

    return asyncio.run(run())


@dataclass
class Fleet:
    """Processes it starts are stopped together (SIGTERM, then SIGKILL) when `stack` closes, after whatever
    was entered into `stack` after the Fleet was made."""

    redis_url: str
    model_dir: Path
    adapter_root: Path
    log_dir: Path
    stack: ExitStack
    api_keys: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    logs: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stack.callback(stop_processes, self.processes)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def redis(self) -> redis.Redis:
        return sync_redis(self.redis_url)

    def start_gateway(self, *flags: str) -> subprocess.Popen:
        log = self._log("gateway")
        args = ["gateway", "--redis-url", self.redis_url, "--port", str(self.port), *GATEWAY_FLAGS, *flags]
        process = self._start(args, log)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(ready, timeout_s=60, what="the gateway", logs=self.logs)
        return process

    def start_worker(self, name: str, *flags: str) -> subprocess.Popen:
        """Start a CPU worker called `name` and wait until it heartbeats."""
        args = ["worker", "--redis-url", self.redis_url, "--model", f"{MODEL}={self.model_dir}"]
        args += ["--adapter-root", str(self.adapter_root), "--worker-id", name, *WORKER_FLAGS, *flags]
        log = self._log(name)
        process = self._start(args, log)
        with self.redis() as client:

            def ready() -> bool:
                if process.poll() is not None:
                    raise AssertionError(f"worker {name} exited:\n{log.read_text()[-3000:]}")
                return client.sismember(keys.WORKERS, name) == 1

            wait_until(ready, timeout_s=90, what=f"worker {name}", logs=self.logs)
        return process

    def log_of(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def redeliveries(self, *workers: str) -> Counter[str]:
        """Per job id, how many times `workers` started it again after taking over its entry from a worker that
        had started it (XAUTOCLAIM): each was one more attempt. An entry taken over before any start is not one."""
        starts: Counter[str] = Counter()
        for worker in workers:
            for line in self.log_of(worker).read_text().splitlines():
                if "job_started" not in line:
                    continue
                event = json.loads(line)
                if event["event"] == "job_started" and event["arrival"] == "reclaimed" and event["attempt"] > 1:
                    starts[event["job"]] += 1
        return starts

    def _start(self, args: list[str], log: Path) -> subprocess.Popen:
        self.processes.append(start_lorafleet(args, log))
        return self.processes[-1]

    def _log(self, name: str) -> Path:
        self.logs.append(self.log_of(name))
        return self.log_of(name)

    def submit(self, jobs: list[dict]) -> list[str]:
        """POST every job as the demo's first tenant; returns their ids."""
        return self.submit_as(TENANT, jobs)

    def submit_as(self, tenant: str, jobs: list[dict]) -> list[str]:
        """POST every job as `tenant`; returns their ids."""
        headers = {"Authorization": f"Bearer {self.api_keys[tenant]}"}

        async def post_all() -> list[str]:
            async with aiohttp.ClientSession(headers=headers) as session:

                async def post(job: dict) -> str:
                    async with session.post(f"{self.url}/v1/jobs", json=job) as response:
                        assert response.status == 202, await response.text()
                        return (await response.json())["id"]

                return list(await asyncio.gather(*(post(job) for job in jobs)))

        return asyncio.run(post_all())

    def cancel(self, job_id: str) -> dict:
        """Cancel a job of the demo's first tenant through the API; returns the job after the call."""
        request = urllib.request.Request(
            f"{self.url}/v1/jobs/{job_id}/cancel",
            method="POST",
            headers={"Authorization": f"Bearer {self.api_keys[TENANT]}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def records(self, job_ids: list[str]) -> list[JobRecord]:
        with self.redis() as client, client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(keys.job(job_id))
            return [JobRecord.from_hash(raw) for raw in pipe.execute()]

    def wait_finished(self, job_ids: list[str], timeout_s: float) -> list[JobRecord]:
        def finished() -> bool:
            return all(r.status.is_terminal for r in self.records(job_ids))

        wait_until(finished, timeout_s=timeout_s, what=f"{len(job_ids)} jobs to finish", logs=self.logs)
        return self.records(job_ids)

    def running_on(self, worker: str, job_ids: list[str]) -> int:
        return sum(r.status is JobStatus.RUNNING and r.worker == worker for r in self.records(job_ids))

    def end_events(self, job_id: str) -> int:
        with self.redis() as client:
            return sum(fields[b"type"] == b"end" for _, fields in client.xrange(keys.job_events(job_id)))

    def assert_nothing_lost(self, job_ids: list[str], records: list[JobRecord]) -> None:
        """Every job succeeded with exactly one stored result, and the queue holds nothing of them."""
        failed = [r for r in records if r.status is not JobStatus.SUCCEEDED]
        assert not failed, f"{len(failed)} of {len(job_ids)} jobs did not succeed: {failed[:3]}"
        for job_id, record in zip(job_ids, records, strict=True):
            assert len(record.output.token_ids) == record.completion_tokens > 0
            assert self.end_events(job_id) == 1, f"job {job_id} was finished more than once"
        with self.redis() as client:
            # a dead worker's entries whose jobs another worker already re-ran stay on its stream until
            # a live one re-claims them (XAUTOCLAIM, CLAIM_IDLE_MS after their delivery), finds the job
            # finished and drops them, seconds after the last job ended
            wait_until(
                lambda: all(client.xlen(stream) == 0 for stream in self.streams()),
                timeout_s=15,
                what="every stream to drain of the finished jobs' entries",
            )
            for stream in self.streams():
                if client.exists(stream):
                    assert client.xpending(stream, keys.WORKER_GROUP)["pending"] == 0, stream
            assert client.xlen(keys.DEAD_LETTER) == 0

    def streams(self) -> list[str]:
        """The model's shared streams (both classes) and every worker stream listed for it (routing)."""
        with self.redis() as client:
            members = sorted(member.decode() for member in client.smembers(keys.worker_queues(MODEL)))
        return [*(keys.queue(MODEL, priority) for priority in PRIORITIES), *members]


def jobs_for(count: int, max_tokens: int) -> list[dict]:
    """`count` greedy jobs over a few prompts, half of them through the tenant's adapter: a re-run
    must reproduce the same tokens, so equal jobs must have equal outputs."""
    prompts = ["Once upon a time", "The quick brown fox", "In the beginning", "It was a dark night"]
    jobs = []
    for index in range(count):
        job = {"model": MODEL, "prompt": prompts[index % 4], "max_tokens": max_tokens, "temperature": 0.0}
        job["ignore_eos"] = True
        if index % 2:
            job["adapter"] = DEMO_ADAPTERS[0].name
        jobs.append(job)
    return jobs


def assert_equal_jobs_equal_outputs(jobs: list[dict], records: list[JobRecord]) -> None:
    outputs: dict[str, set[tuple[int, ...]]] = {}
    for job, record in zip(jobs, records, strict=True):
        outputs.setdefault(json.dumps(job, sort_keys=True), set()).add(record.output.token_ids)
    assert all(len(variants) == 1 for variants in outputs.values()), "a re-run job produced different tokens"


def open_fleet(redis_url: str, assets: tuple[Path, Path], log_dir: Path, stack: ExitStack) -> Fleet:
    """A Fleet with the demo tenants and adapters registered in `redis_url`; no process started yet."""
    model_dir, adapter_root = assets
    fleet = Fleet(redis_url, model_dir, adapter_root, log_dir, stack)
    fleet.api_keys = provision(redis_url, model_dir, adapter_root)
    return fleet
