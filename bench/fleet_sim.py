"""What partitioning adapters can give at most: bench/fleet.py's workload replayed on LRU caches, no engine.

Each worker is an LRU of `pool` adapters. The shared design sends each job to a uniformly random worker;
the routed one to its adapter's rendezvous home (gateway/routing.py's rank, every job on its home: no
room limit, no spill, no backlog overflow, no steal). A job hits when its adapter is in its worker's
cache. The phases are bench/fleet.py's: a warm-up (not counted), a burst and the arrivals (counted), their
names drawn by Zipf over one popularity order, or (`--reshuffle`) a new order per phase, as the bench did
before 9b8dd48. Prints the GPU-tier hit rates and routed/shared, means over `--seeds` seeds.

    python -m bench.fleet_sim --workers 4 --pool 32 --seeds 8
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict

from gateway.routing import rendezvous_rank


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=32, help="adapters in each worker's cache")
    parser.add_argument("--warmup", type=int, default=600)
    parser.add_argument("--jobs", type=int, default=400, help="jobs per measured phase (the burst, the arrivals)")
    parser.add_argument("--reshuffle", action="store_true", help="a new popularity order per phase")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    shared = sum(hit_rate(False, seed, args) for seed in range(args.seeds)) / args.seeds
    routed = sum(hit_rate(True, seed, args) for seed in range(args.seeds)) / args.seeds
    print(f"shared {shared:.1%}, routed {routed:.1%}, routed/shared x{routed / shared:.2f}")


if __name__ == "__main__":
    main()
