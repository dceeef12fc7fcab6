"""A model of bench/fleet.py's fleet in simulated time: the gateway's placement (gateway/routing.py's `place`,
fed by heartbeats), each worker's stream, read-ahead, running slots and steals, and each worker's GPU tier
(worker/adapter_pool/eviction.py's policies over `pool` adapters; the host tier unbounded, as this
workload's rank-4 adapters nearly are). No engine: a job runs for `service_s` once it has a running slot.

What it measures is what the bench prints: the GPU-tier hit rate (the tier of each job's adapter when its
worker read it), and where the jobs ran: on their adapter's home, or off it, and what put them there (the
placement that chose another worker, or a steal).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from gateway.routing import HOME_SLACK, Placement, WorkerView, place
from worker.adapter_pool.eviction import EvictionPolicy, make_policy

MODEL = "m"


@dataclass(frozen=True, slots=True)
class FleetShape:
    """The bench's worker flags and timings (bench/fleet.py's defaults), in seconds."""

    workers: int = 4
    pool: int = 32
    max_num_seqs: int = 8  # running slots; a worker holds twice as many jobs (read ahead)
    service_s: float = 0.8  # a job's time in a running slot (a CPU worker: ~10 jobs/s)
    heartbeat_s: float = 0.5
    refresh_s: float = 0.25  # the gateway's re-read of the heartbeats
    steal_after_ms: int = 500
    submit_per_s: float = 500.0  # a burst's jobs reach the gateway at this rate
    tick_s: float = 0.005


@dataclass(slots=True)
class Job:
    adapter: str
    at: float  # submitted, s
    home: str = ""  # the adapter's home as the gateway saw it ("" on the shared stream)
    placement: Placement = Placement.SHARED
    worker: str = ""  # ran on
    stolen: bool = False
    tier: str = ""  # "gpu", "host", "disk" when read
    read_at: float = 0.0
    started_at: float = 0.0  # into a running slot: the first token's proxy
    measured: bool = False


@dataclass
class Worker:
    name: str
    policy: EvictionPolicy
    capacity: int
    stream: deque[Job] = field(default_factory=deque)
    engine: deque[Job] = field(default_factory=deque)  # read, waiting for a running slot
    running: list[tuple[float, int, Job]] = field(default_factory=list)  # a heap of (ends at, order, job)
    gpu: set[str] = field(default_factory=set)
    host: set[str] = field(default_factory=set)
    demand: Counter[str] = field(default_factory=Counter)  # uid → jobs read, unfinished
    last_steal: float = -1.0

    @property
    def in_flight(self) -> int:
        return len(self.engine) + len(self.running)

    def load(self, job: Job, pool: int) -> None:
        """`job` was read: its adapter onto the GPU tier (the pool prefetches every read job's adapter),
        evicting an adapter no read job names."""
        uid = job.adapter
        job.tier = "gpu" if uid in self.gpu else "host" if uid in self.host else "disk"
        self.demand[uid] += 1
        self.host.add(uid)
        if uid in self.gpu:
            return
        if len(self.gpu) >= pool:
            victim = self.policy.victim(lambda other: self.demand[other] == 0)
            if victim is None:  # every adapter named by a read job: the pool would wait; here, one over
                victim = self.policy.victim(lambda other: True)
            self.gpu.discard(victim)
            self.policy.forget(victim)
        self.gpu.add(uid)
        self.policy.touch(uid)


class FleetModel:
    """One fleet of one design ("shared" or "routed"), driven by `run(jobs)`."""

    def __init__(self, shape: FleetShape, routed: bool, policy: str = "lru", home_slack: float = HOME_SLACK) -> None:
        """`policy`: the GPU tiers' eviction (worker/adapter_pool/eviction.py's names); `home_slack`: the
        gateway's (gateway/routing.py)."""
        self.shape = shape
        self.routed = routed
        self.home_slack = home_slack
        self.workers = [Worker(f"w{i}", make_policy(policy), 2 * shape.max_num_seqs) for i in range(shape.workers)]
        self.shared: deque[Job] = deque()
        self.now = 0.0
        self._views: list[WorkerView] = []
        self._views_at = -1.0
        self._beats: dict[str, tuple[float, int]] = {}  # worker → (beat time, room then)
        self._placed: dict[str, list[float]] = {}
        self._order = itertools.count()

    def run(self, jobs: list[Job]) -> None:
        """Submit `jobs` at their `at` (s, from now on) and run until every one has finished."""
        pending = sorted(jobs, key=lambda job: job.at)
        start = self.now
        for job in pending:
            job.at += start
        queue = deque(pending)
        left = len(jobs)
        while left:
            while queue and queue[0].at <= self.now:
                self._submit(queue.popleft())
            for worker in self.workers:
                left -= self._step(worker)
            self.now += self.shape.tick_s

    def _submit(self, job: Job) -> None:
        if not self.routed:
            self.shared.append(job)
            return
        views = self._view()
        placed = {w.worker_id: sum(t > w.beat_ms / 1000 for t in self._placed.get(w.worker_id, [])) for w in views}
        route = place(MODEL, job.adapter, views, placed, home_slack=self.home_slack)
        job.home, job.placement = route.home, route.placement
        self._placed.setdefault(route.worker, []).append(self.now)
        next(w for w in self.workers if w.name == route.worker).stream.append(job)

    def _view(self) -> list[WorkerView]:
        """The gateway's view: each worker as of its last heartbeat, re-read every refresh_s."""
        if self.now - self._views_at >= self.shape.refresh_s:
            self._views_at = self.now
            self._views = []
            for worker in self.workers:
                beat_at, snapshot = self._beats.get(worker.name, (0.0, (frozenset(), frozenset(), worker.capacity)))
                gpu, host, room = snapshot
                self._views.append(WorkerView(worker.name, gpu, host, room, worker.capacity, int(beat_at * 1000)))
        return self._views

    def _step(self, worker: Worker) -> int:
        """One tick of `worker`: finish, start, read, steal, beat. Returns how many jobs finished."""
        finished = 0
        while worker.running and worker.running[0][0] <= self.now:
            _, _, job = heapq.heappop(worker.running)
            worker.demand[job.adapter] -= 1
            finished += 1
        while worker.engine and len(worker.running) < self.shape.max_num_seqs:
            job = worker.engine.popleft()
            worker.policy.touch(job.adapter)
            job.started_at = self.now
            heapq.heappush(worker.running, (self.now + self.shape.service_s, next(self._order), job))
        room = worker.capacity - worker.in_flight
        while room > 0 and (worker.stream or self.shared):  # the oldest first, as the worker's read_oldest
            sources = [source for source in (worker.stream, self.shared) if source]
            self._read(worker, min(sources, key=lambda source: source[0].at).popleft())
            room -= 1
        free = min(room, self.shape.max_num_seqs - worker.in_flight)
        steal_every = self.shape.steal_after_ms / 4000
        if self.routed and free > 0 and self.now - worker.last_steal >= steal_every:
            worker.last_steal = self.now
            for other in self.workers:
                while other is not worker and free > 0 and other.stream:
                    if self.now - other.stream[0].at < self.shape.steal_after_ms / 1000:
                        break
                    job = other.stream.popleft()
                    job.stolen = True
                    self._read(worker, job)
                    free -= 1
        last = self._beats.get(worker.name, (-1.0, None))[0]
        if self.now - last >= self.shape.heartbeat_s:
            snapshot = (frozenset(worker.gpu), frozenset(worker.host), worker.capacity - worker.in_flight
                        - len(worker.stream))  # fmt: skip
            self._beats[worker.name] = (self.now, snapshot)
        return finished

    def _read(self, worker: Worker, job: Job) -> None:
        job.worker, job.read_at = worker.name, self.now
        worker.load(job, self.shape.pool)
        worker.engine.append(job)
