"""One design of the fleet bench on a fresh fleet, measured: Redis and the adapters registered, the fleet
started (bench/fleet_processes.py), a warm-up, a burst (saturation throughput) and Poisson arrivals
(waits, from the jobs' records and traces), the GPU-tier hit rate and arrivals from the workers'
heartbeats, where the jobs ran (bench/fleet_placement.py); with `--kill`, a worker killed -9 mid-run and
the lost jobs counted. The workload is bench/fleet_workload.py's; the result a `Phase` (bench/fleet_report.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import ExitStack
from pathlib import Path

import redis

from bench.fleet_placement import gateway_placements, placement_split
from bench.fleet_processes import Fleet, FleetError, say, start_fleet
from bench.fleet_report import Phase
from bench.fleet_workload import MODEL, popularity, provision, submit, zipf_names
from cli.redis_server import RedisServer
from shared import keys
from shared.schema import JobTrace


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
