"""Where a job waits: adapter-aware placement across a model's workers, decided from their heartbeats.

A base-model job, a job of a model with no live worker known, or any job with routing off goes to
the model's shared stream, which every worker of the model reads. A job for adapter A goes to one
worker's own stream (`lf:wq:{model}:{worker}`), the first of:

1. a worker holding A in its GPU slots, with room;
2. a worker holding A in pinned host memory, with room;
3. A's home: the live worker ranked first by rendezvous hashing of (A, worker), so each worker is
   home to a stable share of the adapters and a worker joining or leaving moves only its share;
   the home takes the job while it holds fewer than HOME_SLACK of its capacity past it (a job run
   off its home misses there and leaves a copy that takes a slot of another worker's share; a
   short queue on the home costs less, and the steal bound caps it);
4. if the home is past that while another worker has room, the worker with most room (a spill:
   rather that than a wait the steal bound would only shorten);
5. if no worker has room (a burst, or the fleet saturated), the backlog waits on the workers'
   own streams all the same, by consistent hashing with bounded loads: the first of A's holders
   (GPU, then host) and then of A's rendezvous order whose load stays under BALANCE times the
   fleet's mean load. The backlog keeps the locality the rules above give (sent to the shared
   stream, the first worker to free a slot would take it, and a burst would undo the partition of
   adapters), and no worker's queue grows past BALANCE times the mean, so none is left with more
   than its share while another empties; a worker that empties early steals what waited longest.

Among several holders of A (rules 1, 2 and 5) the first in A's rendezvous order takes the job: the
home when it holds A. A second copy (made by a spill, a backlog overflow, a steal or a re-claim) then
gets A's jobs only while the first holder is full, and ages out of its worker's cache, rather than
both copies being kept warm by jobs spread over them by room (docs/benchmarks.md, "A fleet").

Room is a worker's job capacity less its running jobs and the jobs waiting on its own stream, as of
its last heartbeat, less what this gateway placed on it after that heartbeat; load is capacity less
room. A job that still ends up waiting on a busy worker is taken by a worker with free slots after
`steal_after_ms` (worker/routed_streams.py).

The fleet's view is read at most every REFRESH_S per gateway process (one SMEMBERS and one
pipelined HGETALL per worker), not per job. A read often finds a heartbeat it has seen (workers beat
every 0.5 s by default, twice REFRESH_S), so what this gateway placed is kept per worker with the
time it placed it, and only what was placed before the heartbeat it reads is dropped: the record
counts those already. The times compare the gateway's clock with the worker's (`updated_ms`), which
agree to a few ms on hosts kept in time (NTP); a skew only counts the few jobs placed within it
twice or not at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import Counter
from redis.asyncio import Redis

from shared import keys

REFRESH_S = 0.25
# bounded loads (rule 5): a worker takes a backlog job only while its load is under this times the mean;
# 1.25 is the balance Mirrokni, Thorup and Zadimoghaddam's consistent hashing with bounded loads uses,
# which keeps the moves when workers come and go few
BALANCE = 1.25
# rule 3: the home takes a job until this share of its capacity waits past it (4 jobs of a worker holding
# 16). bench/fleet_sim.py --model, bench/fleet.py's 4-worker workload, 16 seeds: GPU-tier hits 58.8 % against
# 58.1 % at 0 (a spill as soon as the home is full), jobs run off their home 9.8 % against 11.1 % (spills
# 0.2 % against 1.7 %), first-token p99 0.54 s against 0.46 s (the shared stream's 0.81 s)
HOME_SLACK = 0.25


class Placement(StrEnum):
    SHARED = "shared"
    GPU = "gpu"
    HOST = "host"
    HOME = "home"
    SPILL = "spill"
    BACKLOG = "backlog"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One live worker of one model, as its last heartbeat said."""

    worker_id: str
    gpu: frozenset[str]  # adapter uids in its device slots
    host: frozenset[str]  # adapter uids in its pinned host tier
    room: int  # jobs it can take before it has more than its capacity
    capacity: int  # jobs it holds at most (running and read ahead)
    beat_ms: int = 0  # when the heartbeat this view is of was written (unix ms, the worker's clock)


@dataclass(frozen=True, slots=True)
class Route:
    queue: str | None  # a worker's stream; None: the model's shared stream
    placement: Placement
    worker: str | None = None
    home: str | None = None  # the adapter's home among the live workers; None on the shared stream

    @property
    def away(self) -> bool:
        """Placed on a worker other than its adapter's home."""
        return self.worker != self.home


def rendezvous_rank(adapter_uid: str, worker_id: str) -> int:
    """Highest-random-weight hashing: an adapter's home is the worker with the highest rank."""
    digest = hashlib.blake2b(f"{adapter_uid}\0{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def place(
    model: str, adapter_uid: str | None, workers: list[WorkerView], placed: dict[str, int], *,
    home_slack: float = HOME_SLACK,
) -> Route:  # fmt: skip
    """The route of one job (the rules in the module docstring). `placed`: jobs this gateway put on each
    worker since `workers` was read; `home_slack`: rule 3's share of the home's capacity (bench/fleet_sim.py
    compares values)."""
    if adapter_uid is None or not workers:
        return Route(None, Placement.SHARED)

    def room(worker: WorkerView) -> int:
        return worker.room - placed.get(worker.worker_id, 0)

    by_rank = sorted(workers, key=lambda w: rendezvous_rank(adapter_uid, w.worker_id), reverse=True)
    home = by_rank[0]

    def route(placement: Placement, worker: WorkerView) -> Route:
        return Route(keys.worker_queue(model, worker.worker_id), placement, worker.worker_id, home.worker_id)

    gpu_holders = [w for w in by_rank if adapter_uid in w.gpu]
    host_holders = [w for w in by_rank if adapter_uid in w.host]
    for placement, holders in ((Placement.GPU, gpu_holders), (Placement.HOST, host_holders)):
        chosen = next((w for w in holders if room(w) > 0), None)
        if chosen is not None:
            return route(placement, chosen)
    if room(home) > -home_slack * home.capacity:
        return route(Placement.HOME, home)
    roomiest = max(workers, key=room)
    if room(roomiest) > 0:
        return route(Placement.SPILL, roomiest)

    def load(worker: WorkerView) -> int:
        return worker.capacity - room(worker)

    bound = BALANCE * (sum(load(w) for w in workers) + 1) / len(workers)
    chosen = next((w for w in gpu_holders + host_holders + by_rank if load(w) < bound), min(workers, key=load))
    return route(Placement.BACKLOG, chosen)


def parse_worker(model: str, worker_id: str, raw: dict[bytes, bytes]) -> WorkerView | None:
    """The worker's view for `model` from its heartbeat hash; None when the model is not resident there
    (its stream would not be read) or the record is unreadable (skipped: routing is a preference)."""
    try:
        resident = json.loads(raw[b"adapters"]).get(model)
        if resident is None:
            return None
        waiting = json.loads(raw.get(b"routed_waiting", b"{}")).get(model, 0)
        capacity = int(raw[b"capacity"])
        room = capacity - int(raw[b"in_flight"]) - int(waiting)
        beat_ms = int(raw.get(b"updated_ms", 0))
        return WorkerView(worker_id, frozenset(resident["gpu"]), frozenset(resident["cpu"]), room, capacity, beat_ms)
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


class FleetView:
    """The live workers of every model, re-read from their heartbeats at most every REFRESH_S."""

    def __init__(self, redis: Redis, placed: Counter, placed_away: Counter, *, refresh_s: float = REFRESH_S) -> None:
        """`placed`: the gateway's counter of jobs by model and placement; `placed_away`: of those placed
        off their adapter's home."""
        self._redis = redis
        self._counter = placed
        self._away_counter = placed_away
        self._refresh_s = refresh_s
        self._read_at = -float("inf")
        self._records: dict[str, dict[bytes, bytes]] = {}
        self._by_model: dict[str, list[WorkerView]] = {}
        # per worker, the unix ms of each job this gateway placed on it that its last heartbeat read may not count
        self._placed_ms: dict[str, list[int]] = {}
        self._reading: asyncio.Task[None] | None = None

    async def route(self, model: str, adapter_uid: str | None) -> Route:
        """Where a job of `model` with `adapter_uid` (None: the base model) should wait."""
        if adapter_uid is None:
            self._counter.labels(model, Placement.SHARED).inc()
            return Route(None, Placement.SHARED)
        if time.monotonic() - self._read_at > self._refresh_s:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.create_task(self._read())
            await asyncio.shield(self._reading)  # concurrent submits share one read
        workers = self._by_model.get(model)
        if workers is None:
            workers = [w for w in (parse_worker(model, i, r) for i, r in self._records.items()) if w is not None]
            self._by_model[model] = workers
        placed = {worker.worker_id: self._placed_since(worker) for worker in workers}
        route = place(model, adapter_uid, workers, placed)
        if route.worker is not None:
            self._placed_ms.setdefault(route.worker, []).append(int(time.time() * 1000))
        self._counter.labels(model, route.placement).inc()
        if route.worker is not None and route.away:
            self._away_counter.labels(model, route.placement).inc()
        return route

    def _placed_since(self, worker: WorkerView) -> int:
        """Jobs this gateway placed on `worker` after the heartbeat `worker` was read from (the others
        are dropped: that heartbeat and every later one count them)."""
        times = self._placed_ms.get(worker.worker_id)
        if not times:
            return 0
        if times[0] <= worker.beat_ms:
            times[:] = [t for t in times if t > worker.beat_ms]
        return len(times)

    async def _read(self) -> None:
        worker_ids = sorted(member.decode() for member in await self._redis.smembers(keys.WORKERS))
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hgetall(keys.worker(worker_id))
            records = await pipe.execute()
        # a worker whose hash expired is gone (its heartbeat stopped), whatever the set still says
        self._records = {worker_id: raw for worker_id, raw in zip(worker_ids, records, strict=True) if raw}
        self._placed_ms = {w: times for w, times in self._placed_ms.items() if w in self._records}
        self._by_model = {}
        self._read_at = time.monotonic()
