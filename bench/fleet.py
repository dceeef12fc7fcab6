"""A fleet, not N copies: adapter-aware routing against the shared stream, each on its own fresh fleet.

(a) CPU (default): the random-weight demo model, N worker processes (`--workers 2,4,8`), `--adapters`
registered adapters (rank 4), Zipf(`--zipf`) traffic over one popularity order per fleet (its warm-up,
burst and arrivals share their popular adapters), each worker's GPU tier `--pool` adapters. Per worker
count and design (routing on; routing off: every job on the shared stream, the design before), a
fresh fleet (Redis, one gateway, N workers) first takes `--warmup` jobs (not measured: the caches
reach their steady state, past the compulsory misses), then a burst of `--jobs` jobs at once
(saturation throughput), then `--jobs` open-loop Poisson arrivals at `--load` of the shared design's
saturation throughput (waits p50/p99: created to read by a worker, the figure recorded before, and
created to first token, the wait a job has before it is served; and end-to-end p99: created to
finished). Over the burst and the arrivals, the GPU-tier hit rate (the tier each job's adapter was
in when its worker read it) and how jobs arrived (routed / shared / stolen / reclaimed), from the
workers' heartbeats. The designs alternate over `--repeats` (shared first, then routed first, ...)
so that a machine shared with other work loads both alike; the ratios are the medians over repeats.

The read wait leaves out what a job waits inside its worker: a worker reads up to twice its batch
(`--max-num-seqs`), so on the shared stream a job is read by whichever worker has read-ahead room and
then waits in that worker's engine, while a routed job waits on its own worker's stream. The wait to
the first token (the jobs' traces, shared/schema.py JobTrace) counts both alike; the p99 wait target
is judged on it. Its last part, in the engine to the first token (the prefill, with what the engine
ran before it; p50), is printed beside it.
`--kill` then kills one worker -9 mid-run in the last routed fleet and counts lost jobs.

On CPU each worker runs one intra-op thread (OMP_NUM_THREADS=1): N processes on a few cores with
torch's default (a thread per core each) spin against each other, and a worker whose asyncio loop
waits for a core reads its own stream late, which the shared stream hides (any worker may read it).

(b) GPU: `--device cuda --workers 2 --gpu-memory-fraction 0.45` runs two workers on one GPU; start
the MPS control daemon first (deploy/mps/) and export its CUDA_MPS_PIPE_DIRECTORY in the bench's shell
(the workers inherit the bench's environment, and the bench prints what they get). The workload is
the same as on CPU: the random-weight demo model (4 layers, hidden 256), 8-token jobs. What a GPU fleet
costs is its start, paid twice (a fresh fleet per design): CUDA and MPS client set-up, Triton's first
compiles (cached for the second fleet), and the CUDA graphs: decode graphs for 1-8 sequences, and
piecewise prefill graphs for a ladder of token counts up to --max-num-batched-tokens (26 buckets at the
default 2,048, 6 at 128). So on the GPU each worker also gets `--max-num-batched-tokens 128` (a step
here runs at most 8 sequences of a few-token prompt: the limit never binds, only the capture shrinks)
and `--num-kv-blocks 4096` (a sequence needs one 16-token block; the default would carve ~35 GB of
KV cache per worker out of its 45 %). Whatever their start costs, the jobs are the CPU run's:
600 warm-up jobs bring both designs' GPU tiers past their compulsory misses, and the burst, the
arrivals at 80 % of the shared fleet's saturation and the kill -9 measure the hit rate, throughput,
p99 wait and lost jobs the targets name. With 10-minute device calls:

    export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
    bash deploy/mps/start.sh
    timeout -k 30 480 python3 -m bench.fleet --device cuda --workers 2 --gpu-memory-fraction 0.45 \
        --adapters 1000 --jobs 400 --warmup 600 --repeats 1 --kill --start-timeout-s 180 --phase-timeout-s 120 \
        --worker-flag='--max-num-batched-tokens 128 --num-kv-blocks 4096' --logs-dir "$OUT/fleet"

The workers tune no LoRA plans at start (`--kernel-tune-budget-s 0`; the packaged tables have none
for the demo model's shapes, so each start would tune for up to 120 s, two workers against each other
on one GPU, and both designs run on the same plans either way; `--worker-flag` overrides it).
Every wait is bounded (`--start-timeout-s`, `--phase-timeout-s`), a worker that exits fails the bench at
once (but the one `--kill` kills), a failure prints the log tails of the fleet's processes (as does a
SIGTERM from an outer `timeout`), and a progress line marks each phase (bench/fleet_processes.py).

    python -m bench.fleet --workers 2,4,8 --adapters 1000 --jobs 400 --warmup 600 --repeats 2 --kill
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis

from bench.fleet_placement import PlacementSplit, gateway_placements, placement_split
from bench.fleet_processes import Fleet, FleetError, answers_ok
from cli.demo_adapters import DemoAdapter, write_demo_adapter
from cli.demo_model import write_demo_model
from cli.redis_server import RedisServer, free_port
from shared import keys
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.redis_client import plain_redis
from shared.schema import JobTrace
from shared.tenants import create_tenant
from worker.model.lora_linear import PAGE_RANK

MODEL = "tiny"
ADAPTER_RANK = 4
# the workers' --max-lora-rank: one pool page per slot, so --max-loras (--pool) is the adapters a GPU tier
# holds; at the default 64 a slot is 4 pages, and 4 rank-4 adapters fit in each (a pool of 128, not 32)
SLOT_RANK = PAGE_RANK
TENANT = "bench"
GATEWAY_FLAGS = [
    "--requests-per-min", "100000000", "--tokens-per-min", "1000000000",
    "--max-concurrent-jobs", "1000000", "--max-queue-per-model", "1000000",
]  # fmt: skip
STARTED = time.monotonic()
SUBMIT_TIMEOUT_S = 60.0
TARGETS = (
    "hit rate (4 workers) >= 1.6x shared; throughput >= shared; p99 wait (created to first token) <= 1.2x shared"
    " at the load; 0 lost"
)


@dataclass
class Phase:
    """One design's measurements in one fleet."""

    throughput: float = 0.0  # jobs/s of the burst
    wait_p50_ms: float = 0.0  # of the arrivals: created → read by a worker
    wait_p99_ms: float = 0.0
    served_p50_ms: float = 0.0  # of the arrivals: created → first token (the trace's stamps)
    served_p99_ms: float = 0.0
    in_engine_p50_ms: float = 0.0  # of the arrivals: into the engine → first token (prefill, and steps before it)
    latency_p99_ms: float = 0.0  # of the arrivals: created → finished
    rate: float = 0.0  # jobs/s the arrivals were offered at
    killed: str = ""  # with --kill: what a worker killed -9 mid-run lost
    counts: dict[str, int] | None = None  # arrival/tier → jobs started, over the burst and the arrivals
    split: PlacementSplit | None = None  # where the burst's and the arrivals' jobs ran (bench/fleet_placement.py)

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
    adapter = DemoAdapter(TENANT, "a0000", ADAPTER_RANK, 2 * ADAPTER_RANK, ("q_proj", "v_proj"), seed=1)
    write_demo_adapter(first, adapter, info, model_dir)
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


def popularity(adapters: int, rng: random.Random) -> list[str]:
    """The adapters' names, most popular first: drawn once per fleet, so its warm-up, burst and arrivals
    share one head (the popular adapters are not the first registered)."""
    order = [f"a{index:04d}" for index in range(adapters)]
    rng.shuffle(order)
    return order


def zipf_names(count: int, ranked: list[str], exponent: float, rng: random.Random) -> list[str]:
    """`count` adapter names drawn by Zipf(`exponent`) over `ranked` (most popular first)."""
    weights = [1 / (rank**exponent) for rank in range(1, len(ranked) + 1)]
    return rng.choices(ranked, weights=weights, k=count)


async def submit(url: str, api_key: str, names: list[str], gaps_s: list[float] | None) -> list[str]:
    """POST one job per adapter name, all at once or after each gap (open loop); returns their ids."""
    headers = {"Authorization": f"Bearer {api_key}"}
    connector = aiohttp.TCPConnector(limit=64)
    # a gateway that stops answering fails the bench in a minute (aiohttp's default waits 5 per request)
    timeout = aiohttp.ClientTimeout(total=SUBMIT_TIMEOUT_S)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:

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


def finished(fleet: Fleet, client: redis.Redis, job_ids: list[str], timeout_s: float, what: str
             ) -> list[dict[bytes, bytes]]:  # fmt: skip
    """The records of `job_ids` once none is queued or running; FleetError past `timeout_s` or if a
    worker dies meanwhile."""

    def done() -> int:
        with client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "status")
            return sum(status not in (b"queued", b"running") for status in pipe.execute())

    fleet.wait_for(lambda: done() == len(job_ids), timeout_s, what, lambda: f"{done()} of {len(job_ids)} jobs done")
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        return pipe.execute()


def started_counts(client: redis.Redis, workers: list[str]) -> dict[str, int]:
    total: dict[str, int] = {}
    for worker in workers:
        for key, n in json.loads(client.hget(keys.worker(worker), "started") or b"{}").items():
            total[key] = total.get(key, 0) + n
    return total


def job_traces(records: list[dict[bytes, bytes]]) -> list[JobTrace]:
    """The traces of the job records that carry a complete one (a job not started through a worker's
    intake has none)."""
    traces = []
    for record in records:
        stamps = [int(record.get(name.encode(), 0)) for name in JobTrace.field_names()]
        if all(stamps):
            traces.append(JobTrace(*stamps))
    return traces


def say(message: str) -> None:
    """A progress line, stamped with the seconds since the bench started (flushed: a time limit may cut it)."""
    print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_phase(args, fleet: Fleet, client, redis_url, url, api_key, workers, rng, ranked, rate: float | None,
              label: str) -> Phase:  # fmt: skip
    """A warm-up burst (not measured), a measured burst (saturation throughput), then Poisson arrivals
    at `rate` jobs/s (queue waits); `rate` None: at `--load` of this burst's throughput. `ranked`: the
    adapters, most popular first."""
    if args.warmup:
        start = time.monotonic()
        ids = asyncio.run(submit(url, api_key, zipf_names(args.warmup, ranked, args.zipf, rng), None))
        finished(fleet, client, ids, args.phase_timeout_s, f"{label}: the warm-up")
        say(f"{label}: warm-up of {args.warmup} jobs done in {time.monotonic() - start:.1f} s")
    time.sleep(args.heartbeat * 3)  # the workers' counts so far reach their heartbeats
    before = started_counts(client, workers)
    placed_before = gateway_placements(url, MODEL)
    names = zipf_names(args.jobs, ranked, args.zipf, rng)
    start = time.time()
    ids = asyncio.run(submit(url, api_key, names, None))
    records = finished(fleet, client, ids, args.phase_timeout_s, f"{label}: the burst")
    measured = list(records)
    ends = [int(r[b"finished_ms"]) for r in records if r.get(b"finished_ms")]
    if len(ends) < len(records):
        statuses = sorted({r.get(b"status", b"?").decode() for r in records})
        raise FleetError(f"{label}: {len(records) - len(ends)} of the burst's jobs did not finish ({statuses})\n"
                         f"{fleet.reports()}")  # fmt: skip
    phase = Phase(throughput=len(ids) / max(1e-3, max(ends) / 1000 - start))
    say(f"{label}: burst of {len(ids)} jobs done in {time.time() - start:.1f} s ({phase.throughput:.1f} jobs/s)")
    phase.rate = rate if rate is not None else args.load * phase.throughput
    if phase.rate:
        names = zipf_names(args.jobs, ranked, args.zipf, rng)
        gaps = [rng.expovariate(phase.rate) for _ in names]
        say(f"{label}: {len(names)} arrivals at {phase.rate:.1f} jobs/s (about {sum(gaps):.0f} s)")
        start = time.time()
        ids = asyncio.run(submit(url, api_key, names, gaps))
        records = [r for r in finished(fleet, client, ids, args.phase_timeout_s, f"{label}: the arrivals")
                   if r.get(b"started_ms")]  # fmt: skip
        say(f"{label}: arrivals done in {time.time() - start:.1f} s")
        measured += records
        waits = [int(r[b"started_ms"]) - int(r[b"created_ms"]) for r in records]
        latencies = [int(r[b"finished_ms"]) - int(r[b"created_ms"]) for r in records]
        phase.wait_p50_ms, phase.wait_p99_ms = percentile(waits, 0.5), percentile(waits, 0.99)
        phase.latency_p99_ms = percentile(latencies, 0.99)
        traces = job_traces(records)
        if len(traces) < len(records):
            raise RuntimeError(f"{len(records) - len(traces)} of {len(records)} started jobs have no trace")
        served = [(t.first_token - t.created) / 1000 for t in traces]
        phase.served_p50_ms, phase.served_p99_ms = percentile(served, 0.5), percentile(served, 0.99)
        phase.in_engine_p50_ms = percentile([(t.first_token - t.engine) / 1000 for t in traces], 0.5)
    time.sleep(args.heartbeat * 3)
    after = started_counts(client, workers)
    phase.counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    placed = {k: n - placed_before.get(k, 0) for k, n in gateway_placements(url, MODEL).items()}
    phase.split = placement_split(client, redis_url, MODEL, workers, measured, placed)
    return phase


def worker_flags(args, redis_url: str, model_dir: Path, adapter_root: Path, worker: str) -> list[str]:
    """`lorafleet worker` flags of one worker of the fleet; `--worker-flag`s last, so they win."""
    flags = [
        "worker", "--redis-url", redis_url, "--model", f"{MODEL}={model_dir}", "--adapter-root",
        str(adapter_root), "--worker-id", worker, "--device", args.device, "--max-loras", str(args.pool),
        "--max-lora-rank", str(SLOT_RANK),
        "--max-num-seqs", str(args.max_num_seqs), "--heartbeat-interval", str(args.heartbeat),
        "--claim-idle-ms", str(int(args.heartbeat * 4000)), "--steal-after-ms", str(args.steal_after_ms),
        # no start-up tune of the LoRA plans (the packaged tables have none for the demo model's shapes): it
        # would take up to its 120 s budget at every fleet's start, both workers tuning against each other on
        # one GPU, and both designs run on the same plans either way
        "--kernel-tune-budget-s", "0",
    ]  # fmt: skip
    if args.gpu_memory_fraction:
        flags += ["--gpu-memory-fraction", str(args.gpu_memory_fraction)]
    return flags + [flag for extra in args.worker_flag for flag in extra.split()]


def start_fleet(args, fleet: Fleet, redis_url: str, assets: tuple[Path, Path], workers: list[str], design: str,
                label: str) -> str:  # fmt: skip
    """Start the gateway (routing on for `design` "routed") and the workers; return the gateway's URL once it
    answers and every worker has announced itself. `label`: the fleet's name in progress lines."""
    model_dir, adapter_root = assets
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    routing = "on" if design == "routed" else "off"
    fleet.spawn("gateway", ["gateway", "--redis-url", redis_url, "--port", str(port), "--adapter-routing", routing,
                            *GATEWAY_FLAGS])  # fmt: skip
    # on CPU one intra-op thread a worker (the module's docstring says why)
    worker_env = {"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {}
    for worker in workers:
        fleet.spawn(worker, worker_flags(args, redis_url, model_dir, adapter_root, worker), worker_env)
    start = time.monotonic()
    ready: dict[str, float] = {}
    with redis.Redis.from_url(redis_url) as client:

        def all_ready() -> bool:
            for worker in workers:
                if worker not in ready and client.exists(keys.worker(worker)):
                    ready[worker] = time.monotonic() - start
            return len(ready) == len(workers) and answers_ok(f"{url}/healthz")

        fleet.wait_for(all_ready, args.start_timeout_s, f"{label}: the gateway and {len(workers)} workers to start",
                       lambda: f"workers ready: {sorted(ready) or 'none'}")  # fmt: skip
    each = ", ".join(f"{worker} {ready[worker]:.0f} s" for worker in workers)
    say(f"{label}: fleet started, {len(workers)} workers ready in {time.monotonic() - start:.0f} s ({each})")
    return url


def run_design(args, assets: tuple[Path, Path], n_workers: int, design: str, rate: float | None, log_dir: Path,
               *, kill: bool) -> Phase:  # fmt: skip
    """A fresh fleet of `n_workers` for `design` ("shared": routing off; "routed"), measured by run_phase;
    with `kill`, then a worker killed -9 mid-run (routing on) and the lost jobs counted."""
    model_dir, adapter_root = assets
    log_dir.mkdir(parents=True)
    rng = random.Random(args.seed)  # both designs see the same names and gaps
    ranked = popularity(args.adapters, rng)
    label = f"{design} ({n_workers} workers)"
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer(log_dir, append_only=False))
        start = time.monotonic()
        api_key = asyncio.run(provision(server.url, model_dir, adapter_root, args.adapters))
        say(f"{label}: Redis up, {args.adapters} adapters registered in {time.monotonic() - start:.1f} s; "
            f"logs in {log_dir}")  # fmt: skip
        fleet = stack.enter_context(Fleet(log_dir))
        workers = [f"w{i}" for i in range(n_workers)]
        url = start_fleet(args, fleet, server.url, assets, workers, design, label)
        client = stack.enter_context(redis.Redis.from_url(server.url))
        phase = run_phase(args, fleet, client, server.url, url, api_key, workers, rng, ranked, rate, label)
        if kill:
            names = zipf_names(args.jobs, ranked, args.zipf, rng)
            gaps = [rng.expovariate(phase.rate) for _ in names]
            say(f"{label}: {len(names)} arrivals, {workers[0]} killed -9 after {sum(gaps) / 2:.0f} s")

            async def submit_and_kill() -> list[str]:
                submitting = asyncio.create_task(submit(url, api_key, names, gaps))
                await asyncio.sleep(sum(gaps) / 2)
                fleet.kill(workers[0])
                return await submitting

            ids = asyncio.run(submit_and_kill())
            records = finished(fleet, client, ids, args.phase_timeout_s, f"{label}: the arrivals with the kill")
            lost = sum(r.get(b"status") != b"succeeded" for r in records)
            phase.killed = f"kill -9 of {workers[0]} mid-run (routing on): {lost} of {len(ids)} jobs lost"
    return phase


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def run_fleet(args, assets: tuple[Path, Path], n_workers: int, log_dir: Path) -> None:
    """Both designs with `n_workers`, alternating over the repeats; a table row per design and repeat."""
    print(f"\n{n_workers} workers, {args.adapters} adapters, Zipf({args.zipf}), pool {args.pool}, warm-up "
          f"{args.warmup} jobs, then {args.jobs} jobs per phase")  # fmt: skip
    print(f"{'':52} {'read wait':>16} {'first-token wait':>16} {'in engine':>9}")
    print(f"{'rep':>3} {'design':8} {'gpu hit':>8} {'host':>6} {'disk':>6} {'jobs/s':>8} {'load/s':>7}"
          f" {'p50 ms':>8} {'p99 ms':>7} {'p50 ms':>8} {'p99 ms':>7} {'p50 ms':>8}"
          f" {'e2e p99':>8}  arrivals")  # fmt: skip
    rate: float | None = None  # set by the first fleet (shared): the load is a share of its saturation
    ratios: dict[str, list[float]] = {"hit": [], "throughput": [], "read p99": [], "first-token p99": []}
    for repeat in range(args.repeats):
        designs = ("shared", "routed") if repeat % 2 == 0 else ("routed", "shared")
        phases = {}
        for design in designs:
            kill = args.kill and design == "routed" and repeat == args.repeats - 1
            phase = run_design(args, assets, n_workers, design, rate, log_dir / f"{design}-{repeat}", kill=kill)
            rate = phase.rate
            phases[design] = phase
            print(
                f"{repeat:>3} {design:8} {phase.tier_share('gpu'):8.1%} {phase.tier_share('cpu'):6.1%}"
                f" {phase.tier_share('disk'):6.1%} {phase.throughput:8.1f} {phase.rate:7.1f} {phase.wait_p50_ms:8.0f}"
                f" {phase.wait_p99_ms:7.0f} {phase.served_p50_ms:8.0f} {phase.served_p99_ms:7.0f}"
                f" {phase.in_engine_p50_ms:8.1f} {phase.latency_p99_ms:8.0f}  {phase.arrivals()}",
                flush=True,
            )
            print(f"{'':12} {phase.split.describe() if phase.split else ''}", flush=True)
            if phase.killed:
                print(phase.killed, flush=True)
        shared, routed = phases["shared"], phases["routed"]
        ratios["hit"].append(routed.tier_share("gpu") / max(1e-9, shared.tier_share("gpu")))
        ratios["throughput"].append(routed.throughput / shared.throughput)
        ratios["read p99"].append(routed.wait_p99_ms / max(1.0, shared.wait_p99_ms))
        ratios["first-token p99"].append(routed.served_p99_ms / max(1.0, shared.served_p99_ms))
    each = " ".join("/".join(f"{r:.2f}" for r in repeat) for repeat in zip(*ratios.values(), strict=True))
    print(f"routed/shared, median of {args.repeats}: hit rate x{median(ratios['hit']):.2f}, "
          f"throughput x{median(ratios['throughput']):.2f}, read-wait p99 x{median(ratios['read p99']):.2f} "
          f"(the figure recorded before), first-token-wait p99 x{median(ratios['first-token p99']):.2f} "
          f"(the target's) (each repeat, {'/'.join(ratios)}: {each})")  # fmt: skip


class Terminated(Exception):
    """SIGTERM (an outer `timeout`): raised where the bench is, so the fleet's logs are printed on the way out."""


def on_sigterm(signum, frame) -> None:
    raise Terminated("terminated by SIGTERM (a time limit?)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4,8", help="worker counts to run, comma-separated")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=32, help="adapters in each worker's GPU tier (--max-loras)")
    parser.add_argument("--jobs", type=int, default=400, help="jobs per measured phase (the burst, the arrivals)")
    parser.add_argument("--warmup", type=int, default=600, help="jobs each fleet takes before it is measured")
    parser.add_argument("--repeats", type=int, default=2, help="fleets per design, the designs alternating")
    parser.add_argument("--load", type=float, default=0.8, help="offered load, of the shared design's saturation")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--steal-after-ms", type=int, default=500)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-fraction", type=float, help="each worker's share of the GPU (part b)")
    parser.add_argument("--kill", action="store_true", help="then kill a worker -9 mid-run, routing on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs-dir", type=Path, help="keep the fleets' logs here (default: a new temporary directory)")
    parser.add_argument(
        "--start-timeout-s",
        type=float,
        default=300.0,
        help="a fleet's gateway and workers must be up within this (default: %(default)s)",
    )
    parser.add_argument(
        "--phase-timeout-s",
        type=float,
        default=600.0,
        help="the jobs of each phase (warm-up, burst, arrivals) must finish within this (default: %(default)s)",
    )
    parser.add_argument("--worker-flag", action="append", default=[], metavar="FLAGS",
                        help="more `lorafleet worker` flags for every worker, after the bench's own (repeatable), "
                             "e.g. --worker-flag='--kernel-tune-budget-s 120'")  # fmt: skip
    args = parser.parse_args(argv)
    previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    logs = args.logs_dir.resolve() if args.logs_dir else tmp
    logs.mkdir(parents=True, exist_ok=True)
    say(f"logs: {logs}")
    if args.device.startswith("cuda"):
        shown = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")  # fmt: skip
        say("the workers' GPU environment: " + ", ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in shown))
    try:
        assets = write_assets(tmp, args.adapters)
        for n in (int(part) for part in args.workers.split(",")):
            run_fleet(args, assets, n, logs / f"fleet-{n}")
    except (FleetError, Terminated) as exc:
        print(f"bench.fleet FAILED after {time.monotonic() - STARTED:.0f} s: {exc}\nlogs: {logs}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        shutil.rmtree(tmp / "adapters", ignore_errors=True)
        shutil.rmtree(tmp / "model", ignore_errors=True)
    print(f"targets: {TARGETS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
