"""What partitioning adapters can give, and what routing gives of it: bench/fleet.py's workload replayed
without an engine, in two ways.

- The ceiling (default): each worker an LRU of `pool` adapters. The shared design sends each job to a
  uniformly random worker; the routed one to its adapter's rendezvous home (gateway/routing.py's rank,
  every job on its home: no room limit, no spill, no backlog overflow, no steal). A job hits when its
  adapter is in its worker's cache.
- `--model`: the fleet in simulated time (bench/fleet_model.py): the gateway's own placement rules fed by
  heartbeats, each worker's stream, read-ahead, running slots and steals, its GPU tier under `--policy`.
  Jobs run off their home here as in the bench, and the split of those (by the placement that chose
  another worker, or a steal) is printed with each part's GPU-tier hit rate, beside the wait to a running
  slot (the first token's proxy), p99 over the arrivals. `--home-slack` compares gateway/routing.py's
  HOME_SLACK with other values.

The phases are bench/fleet.py's: a warm-up burst (not counted), a burst and Poisson arrivals at `--load`
of the shared design's burst throughput (counted), their names drawn by Zipf over one popularity order,
or (`--reshuffle`, the ceiling only) a new order per phase, as the bench did before 9b8dd48. Prints the
GPU-tier hit rates and routed/shared, means over `--seeds` seeds.

    python -m bench.fleet_sim --workers 4 --pool 32 --seeds 8
    python -m bench.fleet_sim --workers 4 --pool 32 --seeds 16 --model --home-slack 0,0.25
"""

from __future__ import annotations

import argparse
import random
from collections import Counter, OrderedDict

from bench.fleet_model import FleetModel, FleetShape, Job
from gateway.routing import HOME_SLACK, rendezvous_rank


def hit_rate(routed: bool, seed: int, args: argparse.Namespace) -> float:
    rng = random.Random(seed)
    weights = [1 / (rank**args.zipf) for rank in range(1, args.adapters + 1)]
    workers = [f"w{index}" for index in range(args.workers)]
    names: list[str] = []
    order: list[str] = []
    for phase, count in enumerate((args.warmup, args.jobs, args.jobs)):
        if phase == 0 or args.reshuffle:
            order = [f"a{index:04d}" for index in range(args.adapters)]
            rng.shuffle(order)
        names += rng.choices(order, weights=weights, k=count)
    caches: dict[str, OrderedDict[str, None]] = {worker: OrderedDict() for worker in workers}
    homes: dict[str, str] = {}
    hits = 0
    for index, name in enumerate(names):
        if routed:
            worker = homes.setdefault(name, max(workers, key=lambda w: rendezvous_rank(name, w)))
        else:
            worker = rng.choice(workers)
        cache = caches[worker]
        hit = name in cache
        cache[name] = None
        cache.move_to_end(name)
        if len(cache) > args.pool:
            cache.popitem(last=False)
        hits += hit and index >= args.warmup
    return hits / (len(names) - args.warmup)


def modelled(routed: bool, seed: int, args: argparse.Namespace, home_slack: float, rate: float | None
             ) -> tuple[list[Job], float, float]:  # fmt: skip
    """One fleet of the model through the bench's phases: (the measured jobs, the burst's jobs/s, the
    arrivals' rate); `rate` None: `--load` of this fleet's burst throughput."""
    rng = random.Random(seed)
    weights = [1 / (rank**args.zipf) for rank in range(1, args.adapters + 1)]
    order = [f"a{index:04d}" for index in range(args.adapters)]
    rng.shuffle(order)
    shape = FleetShape(workers=args.workers, pool=args.pool)
    fleet = FleetModel(shape, routed, args.policy, home_slack)

    def burst(count: int) -> list[Job]:
        names = rng.choices(order, weights=weights, k=count)
        return [Job(name, index / shape.submit_per_s) for index, name in enumerate(names)]

    fleet.run(burst(args.warmup))
    jobs = burst(args.jobs)
    start = fleet.now
    fleet.run(jobs)
    throughput = args.jobs / (fleet.now - start)
    rate = rate or args.load * throughput
    at, arrivals = 0.0, []
    for name in rng.choices(order, weights=weights, k=args.jobs):
        arrivals.append(Job(name, at))
        at += rng.expovariate(rate)
    fleet.run(arrivals)
    for job in jobs + arrivals:
        job.measured = job in arrivals
    return jobs + arrivals, throughput, rate


def where(job: Job) -> str:
    """Why a routed job ran where it did: on its home, off it by a steal, or by the placement that chose
    another worker."""
    if job.stolen:
        return "stolen"
    return "home" if job.worker == job.home else f"away by {job.placement.value}"


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def print_model(args: argparse.Namespace) -> None:
    shared_runs = [modelled(False, seed, args, HOME_SLACK, None) for seed in range(args.seeds)]
    shared = [job for jobs, _, _ in shared_runs for job in jobs]
    shared_hit = sum(job.tier == "gpu" for job in shared) / len(shared)
    shared_wait = sum(p99([j.started_at - j.at for j in jobs if j.measured]) for jobs, _, _ in shared_runs)
    print(f"shared: GPU hit {shared_hit:.1%}, first-token p99 {shared_wait / args.seeds * 1000:.0f} ms")
    for slack in (float(value) for value in args.home_slack.split(",")):
        runs = [modelled(True, seed, args, slack, shared_runs[seed][2]) for seed in range(args.seeds)]
        jobs = [job for run, _, _ in runs for job in run]
        hit = sum(job.tier == "gpu" for job in jobs) / len(jobs)
        wait = sum(p99([j.started_at - j.at for j in run if j.measured]) for run, _, _ in runs) / args.seeds
        throughput = sum(t for _, t, _ in runs) / sum(t for _, t, _ in shared_runs)
        parts = Counter(where(job) for job in jobs)
        hits = Counter(where(job) for job in jobs if job.tier == "gpu")
        split = ", ".join(f"{part} {n / len(jobs):.1%} (hit {hits[part] / n:.0%})" for part, n in parts.most_common())
        print(f"routed, home slack {slack:g}: GPU hit {hit:.1%}, x{hit / shared_hit:.2f}; burst throughput "
              f"x{throughput:.2f}; first-token p99 {wait * 1000:.0f} ms, x{wait * args.seeds / shared_wait:.2f}"
              f"\n    {split}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=32, help="adapters in each worker's cache")
    parser.add_argument("--warmup", type=int, default=600)
    parser.add_argument("--jobs", type=int, default=400, help="jobs per measured phase (the burst, the arrivals)")
    parser.add_argument("--reshuffle", action="store_true", help="a new popularity order per phase (the ceiling)")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--model", action="store_true", help="the fleet in simulated time, not the ceiling")
    parser.add_argument("--policy", default="lru", help="--model: the GPU tiers' eviction policy (lru, lfu)")
    parser.add_argument("--load", type=float, default=0.8, help="--model: the arrivals' load, of the shared burst's")
    parser.add_argument("--home-slack", default=str(HOME_SLACK), help="--model: gateway/routing.py's HOME_SLACK "
                        "values to compare, comma-separated (default: %(default)s)")  # fmt: skip
    args = parser.parse_args()
    if args.model:
        print_model(args)
        return
    shared = sum(hit_rate(False, seed, args) for seed in range(args.seeds)) / args.seeds
    routed = sum(hit_rate(True, seed, args) for seed in range(args.seeds)) / args.seeds
    print(f"shared {shared:.1%}, routed {routed:.1%}, routed/shared x{routed / shared:.2f}")


if __name__ == "__main__":
    main()
