"""The flags several commands share, and the defaults their help texts show."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import flag_types
from cli.state import DEFAULT_STATE_DIR
from shared.config import EngineConfig, GatewayConfig, WorkerConfig

ENGINE_DEFAULTS = EngineConfig()
GATEWAY_DEFAULTS = GatewayConfig(redis_url="")
WORKER_DEFAULTS = WorkerConfig(redis_url="", models=(), adapter_root=Path())


def add_redis_flags(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the fleet is")
    where.add_argument("--redis-url", help="Redis of the fleet (default: from --state-dir, else $REDIS_URL)")
    add_sentinel_flags(where)
    where.add_argument(
        "--state-dir", type=Path, help=f"state dir of a running `lorafleet up` (default: {DEFAULT_STATE_DIR})"
    )


def add_sentinel_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--redis-sentinel", metavar="HOST:PORT[,HOST:PORT...]", help="reach the Redis primary through these Sentinels"
    )
    group.add_argument("--redis-master-name", help="the primary's name in the Sentinels (with --redis-sentinel)")


def add_replica_wait_flags(parser: argparse.ArgumentParser) -> None:
    durable = parser.add_argument_group("durable writes (Redis with replicas)")
    durable.add_argument(
        "--redis-wait-replicas",
        type=flag_types.count,
        default=GATEWAY_DEFAULTS.replica_wait.replicas,
        help="replicas that must confirm a new job or a result (Redis WAIT); 0: no wait (default: %(default)s)",
    )
    durable.add_argument(
        "--redis-wait-timeout-ms",
        type=flag_types.positive_int,
        default=GATEWAY_DEFAULTS.replica_wait.timeout_ms,
        help="longest wait for that confirmation; a job unconfirmed by then is withdrawn, 503 (default: %(default)s)",
    )


def add_target_flags(parser: argparse.ArgumentParser) -> None:
    """Which gateway, as which tenant (as `submit` takes them)."""
    parser.add_argument("--url", help="gateway URL (default: the running `up`'s)")
    parser.add_argument("--api-key", help="tenant API key")
    parser.add_argument("--state-dir", type=Path, help=f"a running `up`'s state dir (default: {DEFAULT_STATE_DIR})")
    parser.add_argument("--tenant", help="demo tenant whose key to take from STATE_DIR/demo.json")
