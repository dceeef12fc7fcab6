"""A fleet, not N copies: adapter-aware routing beside the shared stream, on the same workers in one run.

(a) CPU (default): the random-weight demo model, N worker processes (`--workers 2,4,8`), `--adapters`
registered adapters, Zipf(`--zipf`) traffic, each worker's GPU tier `--pool` adapters. Two gateways
share the Redis and the workers: one places adapter jobs (routing on), one puts every job on the
shared stream (routing off, the design before). Per design: saturation throughput (a burst of
`--jobs` jobs at once), then queue wait p50/p99 at `--load` of the shared design's saturation
throughput (open-loop Poisson arrivals), and over both phases the GPU-tier hit rate (the tier each
job's adapter was in when its worker read it) and how jobs arrived (routed / shared / stolen /
reclaimed), from the workers' heartbeats. `--kill` then kills one worker -9 mid-run with routing on
and counts lost jobs.

(b) GPU: `--device cuda --workers 2 --gpu-memory-fraction 0.45` runs two workers on one GPU; start
the MPS control daemon first (deploy/mps/) so they share it under MPS. The rest is the same.

    python -m bench.fleet --workers 2,4 --adapters 1000 --jobs 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis

from cli.demo_adapters import DemoAdapter, write_demo_adapter
from cli.demo_model import write_demo_model
from cli.redis_server import RedisServer, free_port
from shared import keys
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.redis_client import plain_redis
from shared.tenants import create_tenant

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
TENANT = "bench"
GATEWAY_FLAGS = [
    "--requests-per-min", "100000000", "--tokens-per-min", "1000000000",
    "--max-concurrent-jobs", "1000000", "--max-queue-per-model", "1000000",
]  # fmt: skip
TARGETS = "hit rate (4 workers) >= 1.6x shared; throughput >= shared; p99 wait <= 1.2x shared at the load; 0 lost"


@dataclass
class Phase:
    throughput: float = 0.0  # jobs/s of the burst
    wait_p50_ms: float = 0.0
    wait_p99_ms: float = 0.0
    counts: dict[str, int] | None = None  # arrival/tier → jobs started, over both phases

    def tier_share(self, tier: str) -> float:
        with_adapter = {k: n for k, n in (self.counts or {}).items() if not k.endswith("/none")}
        total = sum(with_adapter.values())
        return sum(n for k, n in with_adapter.items() if k.endswith(f"/{tier}")) / total if total else 0.0

    def arrivals(self) -> str:
        by: dict[str, int] = {}
        for key, n in (self.counts or {}).items():
            by[key.split("/")[0]] = by.get(key.split("/")[0], 0) + n
        return " ".join(f"{k}={v}" for k, v in sorted(by.items()))


def write_assets(root: Path, count: int) -> tuple[Path, Path]:
    """The demo model and `count` adapters (one small adapter's files, copied: each has its own name)."""
    model_dir, adapter_root = root / "model", root / "adapters"
    model_dir.mkdir()
    write_demo_model(model_dir)
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    first = adapter_root / TENANT / "a0000"
    first.mkdir(parents=True)
    write_demo_adapter(first, DemoAdapter(TENANT, "a0000", 4, 8, ("q_proj", "v_proj"), seed=1), info, model_dir)
    for index in range(1, count):
        shutil.copytree(first, adapter_root / TENANT / f"a{index:04d}")
    return model_dir, adapter_root


async def provision(redis_url: str, model_dir: Path, adapter_root: Path, count: int) -> str:
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    async with plain_redis(redis_url) as client:
        api_key = await create_tenant(client, TENANT)
        for index in range(count):
            name = f"a{index:04d}"
            await register_adapter(
                client, name=name, tenant=TENANT, model=info, adapter_root=adapter_root,
                path=f"{TENANT}/{name}", max_rank=64, max_bytes=1 << 30,
            )  # fmt: skip
    return api_key


@contextmanager
def process(args: list[str], log: Path):
    with log.open("wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            yield child
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(30)
                except subprocess.TimeoutExpired:
                    child.kill()


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def zipf_names(count: int, adapters: int, exponent: float, rng: random.Random) -> list[str]:
    weights = [1 / (rank**exponent) for rank in range(1, adapters + 1)]
    order = list(range(adapters))
    rng.shuffle(order)  # the popular adapters are not the first registered
    return [f"a{order[i]:04d}" for i in rng.choices(range(adapters), weights=weights, k=count)]


async def submit(url: str, api_key: str, names: list[str], gaps_s: list[float] | None) -> list[str]:
    """POST one job per adapter name, all at once or after each gap (open loop); returns their ids."""
    headers = {"Authorization": f"Bearer {api_key}"}
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:

        async def post(name: str) -> str:
            job = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True,
                   "temperature": 0.0, "adapter": name}  # fmt: skip
            async with session.post(f"{url}/v1/jobs", json=job) as response:
                body = await response.json()
                if response.status != 202:
                    raise RuntimeError(f"submit: {response.status} {body}")
                return body["id"]

        if gaps_s is None:
            return list(await asyncio.gather(*(post(name) for name in names)))
        tasks = []
        for name, gap in zip(names, gaps_s, strict=True):
            tasks.append(asyncio.create_task(post(name)))
            await asyncio.sleep(gap)
        return list(await asyncio.gather(*tasks))


def finished(client: redis.Redis, job_ids: list[str], timeout_s: float) -> list[dict[bytes, bytes]]:
    def records() -> list[dict[bytes, bytes]]:
        with client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(keys.job(job_id))
            return pipe.execute()

    wait_for(lambda: all(r.get(b"status") not in (b"queued", b"running") for r in records()), timeout_s, "jobs")
    return records()


def started_counts(client: redis.Redis, workers: list[str]) -> dict[str, int]:
    total: dict[str, int] = {}
    for worker in workers:
        for key, n in json.loads(client.hget(keys.worker(worker), "started") or b"{}").items():
            total[key] = total.get(key, 0) + n
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_phase(args, client, url, api_key, workers, rng, rate: float | None) -> Phase:
    """A burst (saturation throughput); then, given `rate`, Poisson arrivals at it (queue waits)."""
    before = started_counts(client, workers)
    names = zipf_names(args.jobs, args.adapters, args.zipf, rng)
    start = time.time()
    ids = asyncio.run(submit(url, api_key, names, None))
    records = finished(client, ids, 600)
    ends = [int(r[b"finished_ms"]) for r in records]
    phase = Phase(throughput=len(ids) / max(1e-3, max(ends) / 1000 - start))
    if rate:
        names = zipf_names(args.jobs, args.adapters, args.zipf, rng)
        gaps = [rng.expovariate(rate) for _ in names]
        ids = asyncio.run(submit(url, api_key, names, gaps))
        records = finished(client, ids, 600)
        waits = [int(r[b"started_ms"]) - int(r[b"created_ms"]) for r in records if r.get(b"started_ms")]
        phase.wait_p50_ms, phase.wait_p99_ms = percentile(waits, 0.5), percentile(waits, 0.99)
    time.sleep(args.heartbeat * 3)  # the workers' last counts reach their heartbeats
    after = started_counts(client, workers)
    phase.counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return phase


def run_fleet(args, assets: tuple[Path, Path], n_workers: int, log_dir: Path) -> None:
    model_dir, adapter_root = assets
    rng = random.Random(args.seed)
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer(log_dir, append_only=False))
        api_key = asyncio.run(provision(server.url, model_dir, adapter_root, args.adapters))
        urls = {}
        for design, routing in (("shared", "off"), ("routed", "on")):
            port = free_port()
            urls[design] = f"http://127.0.0.1:{port}"
            flags = ["gateway", "--redis-url", server.url, "--port", str(port), "--adapter-routing", routing]
            stack.enter_context(process([*flags, *GATEWAY_FLAGS], log_dir / f"gateway-{design}.log"))
        workers = [f"w{i}" for i in range(n_workers)]
        children = {}
        for worker in workers:
            flags = [
                "worker", "--redis-url", server.url, "--model", f"{MODEL}={model_dir}", "--adapter-root",
                str(adapter_root), "--worker-id", worker, "--device", args.device, "--max-loras", str(args.pool),
                "--max-num-seqs", str(args.max_num_seqs), "--heartbeat-interval", str(args.heartbeat),
                "--claim-idle-ms", str(int(args.heartbeat * 4000)), "--steal-after-ms", str(args.steal_after_ms),
            ]  # fmt: skip
            if args.gpu_memory_fraction:
                flags += ["--gpu-memory-fraction", str(args.gpu_memory_fraction)]
            children[worker] = stack.enter_context(process(flags, log_dir / f"{worker}.log"))
        client = stack.enter_context(redis.Redis.from_url(server.url))
        for url in urls.values():
            wait_for(lambda url=url: healthy(url), 60, "a gateway")
        wait_for(lambda: all(client.exists(keys.worker(w)) for w in workers), 300, "the workers")
        shared = run_phase(args, client, urls["shared"], api_key, workers, rng, None)
        rate = args.load * shared.throughput
        shared = run_phase(args, client, urls["shared"], api_key, workers, rng, rate)
        routed = run_phase(args, client, urls["routed"], api_key, workers, rng, rate)
        print(f"\n{n_workers} workers, {args.adapters} adapters, Zipf({args.zipf}), pool {args.pool}, "
              f"{args.jobs} jobs per phase, load {rate:.1f} jobs/s ({args.load:.0%} of shared saturation)")  # fmt: skip
        print(
            f"{'design':8} {'gpu hit':>8} {'host':>6} {'disk':>6} {'jobs/s':>8} {'wait p50':>9} {'p99 ms':>8}  arrivals"
        )
        for name, phase in (("shared", shared), ("routed", routed)):
            print(
                f"{name:8} {phase.tier_share('gpu'):8.1%} {phase.tier_share('cpu'):6.1%}"
                f" {phase.tier_share('disk'):6.1%} {phase.throughput:8.1f} {phase.wait_p50_ms:9.0f}"
                f" {phase.wait_p99_ms:8.0f}  {phase.arrivals()}"
            )
        hit_ratio = routed.tier_share("gpu") / max(1e-9, shared.tier_share("gpu"))
        print(f"routed/shared: hit rate x{hit_ratio:.2f}, throughput x{routed.throughput / shared.throughput:.2f}, "
              f"p99 wait x{routed.wait_p99_ms / max(1.0, shared.wait_p99_ms):.2f}")  # fmt: skip
        if args.kill:
            names = zipf_names(args.jobs, args.adapters, args.zipf, rng)
            gaps = [rng.expovariate(rate) for _ in names]

            async def submit_and_kill() -> list[str]:
                submitting = asyncio.create_task(submit(urls["routed"], api_key, names, gaps))
                await asyncio.sleep(sum(gaps) / 2)
                children[workers[0]].send_signal(signal.SIGKILL)
                return await submitting

            ids = asyncio.run(submit_and_kill())
            records = finished(client, ids, 600)
            lost = sum(r.get(b"status") != b"succeeded" for r in records)
            print(f"kill -9 of {workers[0]} mid-run (routing on): {lost} of {len(ids)} jobs lost")
    print(f"targets: {TARGETS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4,8", help="worker counts to run, comma-separated")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=32, help="adapters in each worker's GPU tier (--max-loras)")
    parser.add_argument("--jobs", type=int, default=400, help="jobs per phase")
    parser.add_argument("--load", type=float, default=0.8, help="offered load, of the shared design's saturation")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--steal-after-ms", type=int, default=500)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-fraction", type=float, help="each worker's share of the GPU (part b)")
    parser.add_argument("--kill", action="store_true", help="then kill a worker -9 mid-run, routing on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    print(f"logs: {tmp}")
    assets = write_assets(tmp, args.adapters)
    for n in (int(part) for part in args.workers.split(",")):
        log_dir = tmp / f"fleet-{n}"
        log_dir.mkdir()
        run_fleet(args, assets, n, log_dir)
    shutil.rmtree(tmp / "adapters")


if __name__ == "__main__":
    main()
