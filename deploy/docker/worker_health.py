#!/usr/bin/env python3
"""Exit 0 when a worker's heartbeat in Redis is fresh: the readiness check of a worker container.

A worker has no HTTP port. Once its models are loaded it writes `lf:worker:{id}` every heartbeat
interval (2 s by default; the hash expires after three), with `updated_ms`. The containers start
workers with `--worker-id` set to their hostname (the pod name on Kubernetes), so this check finds
its own worker by hostname unless `--worker-id` is given. REDIS_URL comes from the environment
(a `redis+sentinel://` URL reaches the primary through its Sentinels).

    lorafleet-worker-health [--worker-id ID] [--max-age-s 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import redis

from shared import keys
from shared.redis_client import sync_redis


def heartbeat_problem(client: redis.Redis, worker_id: str, max_age_s: float) -> str | None:
    """Why the worker is not healthy, or None when its heartbeat is at most `max_age_s` old."""
    updated_ms = client.hget(keys.worker(worker_id), "updated_ms")
    if updated_ms is None:
        return f"no heartbeat from worker {worker_id!r} (still loading, or gone)"
    age_s = time.time() - int(updated_ms) / 1000
    if age_s > max_age_s:
        return f"worker {worker_id!r} last beat {age_s:.1f}s ago (limit {max_age_s}s)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet-worker-health", description=__doc__.splitlines()[0])
    parser.add_argument("--worker-id", default=socket.gethostname(), help="default: this host's name")
    parser.add_argument("--max-age-s", type=float, default=10.0, help="oldest acceptable heartbeat")
    args = parser.parse_args(argv)
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        print("REDIS_URL is not set", file=sys.stderr)
        return 2
    try:
        with sync_redis(redis_url, socket_timeout=3, socket_connect_timeout=3) as client:
            problem = heartbeat_problem(client, args.worker_id, args.max_age_s)
    except redis.RedisError as exc:
        problem = f"redis: {exc}"
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
