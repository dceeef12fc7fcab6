"""The parsers of the serving processes `up` and `gateway`."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import commands, flag_types
from cli import config_from_args as cfa
from cli.parsers.common import GATEWAY_DEFAULTS, add_redis_flags, add_replica_wait_flags, add_sentinel_flags
from cli.state import DEFAULT_STATE_DIR


def add_up(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up", help="run Redis, the gateway and workers on this machine (the demo without --model)"
    )
    up.add_argument("--host", default=GATEWAY_DEFAULTS.host, help="gateway bind address (default: %(default)s)")
    up.add_argument(
        "--port", type=flag_types.port_number, default=GATEWAY_DEFAULTS.port, help="gateway port (default: %(default)s)"
    )
    up.add_argument(
        "--state-dir",
        type=Path,
        help=f"Redis data, generated demo files, lorafleet.json (default: {DEFAULT_STATE_DIR})",
    )
    up.add_argument("--redis-url", help="use this Redis instead of starting one (default: $REDIS_URL)")
    add_sentinel_flags(up.add_argument_group("a Redis watched by Sentinels, instead of starting one"))
    up.add_argument(
        "--redis-replicas",
        type=flag_types.count,
        default=0,
        help="start a primary, this many replicas and three Sentinels; jobs wait for one replica (default: 0)",
    )
    up.add_argument(
        "--model",
        type=flag_types.model_spec,
        action="append",
        metavar="NAME=PATH",
        help="HF model dir to serve (repeatable)",
    )
    up.add_argument("--adapter-root", type=Path, help="adapters live under here (default: STATE_DIR/adapters)")
    up.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="one worker per GPU, or one on CPU"
    )
    up.add_argument(
        "--worker-metrics-port",
        type=flag_types.port_or_off,
        default=cfa.DEFAULT_WORKER_METRICS_PORT,
        help="Prometheus metrics of the first worker (the next ones count up); 0: off (default: %(default)s)",
    )
    up.set_defaults(run=commands.up)


def add_gateway(subparsers: argparse._SubParsersAction) -> None:
    gateway = subparsers.add_parser("gateway", help="run one gateway process (HTTP API)")
    add_redis_flags(gateway)
    add_replica_wait_flags(gateway)
    gateway.add_argument("--host", default=GATEWAY_DEFAULTS.host, help="bind address (default: %(default)s)")
    gateway.add_argument(
        "--port", type=flag_types.port_number, default=GATEWAY_DEFAULTS.port, help="port (default: %(default)s)"
    )
    gateway.add_argument(
        "--admin-key-file",
        type=Path,
        help=f"file holding the admin API key (default: ${cfa.ADMIN_KEY_ENV}; neither: the admin API is off)",
    )
    gateway.add_argument(
        "--adapter-root", type=Path, help="adapters registered over HTTP must live here (default: from --state-dir)"
    )
    gateway.add_argument(
        "--adapter-routing",
        choices=("on", "off"),
        default="on" if GATEWAY_DEFAULTS.adapter_routing else "off",
        help="place adapter jobs on the worker holding the adapter; off: any worker takes any job "
        "(default: %(default)s)",
    )
    limits = gateway.add_argument_group("per-tenant admission limits (a tenant's own limits, set by an admin, win)")
    for flag, default in (
        ("--requests-per-min", GATEWAY_DEFAULTS.tenant_limits.requests_per_min),
        ("--tokens-per-min", GATEWAY_DEFAULTS.tenant_limits.tokens_per_min),
        ("--max-concurrent-jobs", GATEWAY_DEFAULTS.tenant_limits.max_concurrent_jobs),
        ("--max-queue-per-model", GATEWAY_DEFAULTS.tenant_limits.max_queue_per_model),
    ):
        limits.add_argument(flag, type=flag_types.positive_int, default=default, help="(default: %(default)s)")
    batches = gateway.add_argument_group("files and batches (the OpenAI Files and Batch APIs; files live in Redis)")
    for flag, default, what in (
        ("--max-file-bytes", GATEWAY_DEFAULTS.batches.max_file_bytes, "largest file upload"),
        ("--max-file-lines", GATEWAY_DEFAULTS.batches.max_file_lines, "most requests in a batch input file"),
        (
            "--batch-lines-in-flight",
            GATEWAY_DEFAULTS.batches.lines_in_flight,
            "lines of one batch queued or running at once",
        ),
    ):
        batches.add_argument(flag, type=flag_types.positive_int, default=default, help=f"{what} (default: %(default)s)")
    webhooks = gateway.add_argument_group("job webhooks (off unless a host is allowed)")
    webhooks.add_argument(
        "--webhook-allow-host",
        action="append",
        metavar="HOST",
        help="a host job webhooks may call; *.example.com allows its subdomains (repeatable)",
    )
    webhooks.add_argument(
        "--webhook-secret-file",
        type=Path,
        help=f"file holding the secret webhook signatures derive from (default: ${cfa.WEBHOOK_SECRET_ENV})",
    )
    webhooks.add_argument(
        "--webhook-allow-http", action="store_true", help="allow plain-http webhook URLs (default: https only)"
    )
    gateway.set_defaults(run=commands.gateway)
