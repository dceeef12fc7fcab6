"""Where the fleet bench's jobs ran against where routing would keep them: the split that says why a
routed fleet's hit rate is what it is (bench/fleet_report.py prints it under each design's row).

- placed: the gateway's placements (`lorafleet_gateway_jobs_placed`) over the measured phase: gpu / host
  (a worker held the adapter), home (its rendezvous home had room), spill, backlog, shared; and "away",
  those of them put on a worker other than the adapter's home (`lorafleet_gateway_jobs_placed_away`), by
  placement: with the workers' stolen jobs (the arrivals), the split of the jobs that ran off their home;
- on home: the share of the measured jobs whose record says they ran on their adapter's rendezvous home
  among the fleet's workers (gateway/routing.py's rank), whatever placed them there;
- copies: GPU-tier copies per adapter held on the device at the end, over all workers (1.0: each adapter
  in one worker's GPU tier, the partition routing aims at; up to the worker count for the shared stream),
  and how many adapters a worker's GPU tier held then.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.local_http import LOCAL_HTTP
from gateway.routing import rendezvous_rank
from shared import keys
from shared.adapter_registry import get_adapter
from shared.redis_client import plain_redis


@dataclass
class PlacementSplit:
    placed: dict[str, int]  # placement → jobs, over the measured phase; "away/" + placement: those off home
    on_home: float  # share of the measured adapter jobs that ran on their adapter's home
    copies: float  # GPU-tier copies per distinct GPU-resident adapter, at the end
    held: float  # adapters in a worker's GPU tier at the end, the mean over workers

    def describe(self) -> str:
        placed = " ".join(f"{k}={v}" for k, v in sorted(self.placed.items()) if v and "/" not in k)
        away = " ".join(f"{k.removeprefix('away/')}={v}" for k, v in sorted(self.placed.items()) if v and "/" in k)
        copies = f"GPU copies per adapter {self.copies:.2f}, {self.held:.0f} held per worker"
        return f"placed {placed or '-'}, of them away from home {away or '-'}; on home {self.on_home:.1%}; {copies}"


def gateway_placements(url: str, model: str) -> dict[str, int]:
    """The gateway's placement counters for `model`, as scraped from its /metrics now: placement → jobs, and
    "away/" + placement → those of them placed off their adapter's home."""
    with LOCAL_HTTP.open(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    prefixes = {"lorafleet_gateway_jobs_placed": "", "lorafleet_gateway_jobs_placed_away": "away/"}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in prefixes:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == model:
                counts[prefixes[family.name] + sample.labels["placement"]] = int(sample.value)
    return counts


def homes(redis_url: str, names: set[str], workers: list[str]) -> dict[str, str]:
    """Adapter name → its rendezvous home among `workers` (the registered version's uid, as the gateway ranks)."""

    async def read() -> dict[str, str]:
        async with plain_redis(redis_url) as client:
            records = [await get_adapter(client, name) for name in sorted(names)]
        return {
            record.name: max(workers, key=lambda worker: rendezvous_rank(record.ref().uid, worker))
            for record in records
            if record is not None
        }

    return asyncio.run(read())


def gpu_residency(client: redis.Redis, model: str, workers: list[str]) -> tuple[float, float]:
    """(GPU-tier copies per distinct adapter held on the workers' devices, adapters held per worker), from
    their heartbeats."""
    held: list[str] = []
    for worker in workers:
        adapters = json.loads(client.hget(keys.worker(worker), "adapters") or b"{}")
        held += adapters.get(model, {}).get("gpu", [])
    return (len(held) / len(set(held)) if held else 0.0), len(held) / len(workers)


def placement_split(
    client: redis.Redis,
    redis_url: str,
    model: str,
    workers: list[str],
    records: list[dict[bytes, bytes]],
    placed: dict[str, int],
) -> PlacementSplit:
    """The split over the measured `records` (job hashes); `placed`: the placements made while they were queued."""
    ran = [(r[b"adapter"].decode(), r[b"worker"].decode()) for r in records if r.get(b"adapter") and r.get(b"worker")]
    home = homes(redis_url, {name for name, _ in ran}, workers)
    on_home = sum(home.get(name) == worker for name, worker in ran) / len(ran) if ran else 0.0
    return PlacementSplit(placed, on_home, *gpu_residency(client, model, workers))
