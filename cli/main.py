"""`lorafleet`: the command-line parser and the entry point that runs the command it names.

The parsers live in cli/parsers/ (one module per command group), what each command runs in
cli/commands.py; importing neither pulls in torch or aiohttp, so `lorafleet --help` and the admin
commands start fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import redis

from cli.errors import CommandError
from cli.own_packages import shadowed_packages
from cli.parsers import admin, clients, quantize, servers, tune, worker
from cli.redis_server import RedisServerError
from shared.errors import LorafleetError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="Multi-tenant LoRA serving.")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        servers.add_up,
        servers.add_gateway,
        worker.add_worker,
        admin.add_admin,
        clients.add_submit,
        clients.add_batch,
        tune.add_tune,
        quantize.add_quantize,
    ):
        add(commands)
    return parser


def _fail(message: str, exit_code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    if shadowed := shadowed_packages():
        return _fail(
            "another installed package shadows lorafleet's own (uninstall it, e.g. `pip uninstall kernels` "
            "for Hugging Face's, or run from a separate environment): " + "; ".join(shadowed),
            1,
        )
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except CommandError as exc:
        return _fail(str(exc), exc.exit_code)
    except LorafleetError as exc:
        return _fail(f"{exc.code}: {exc.message}", 2)
    except RedisServerError as exc:
        return _fail(f"redis-server: {exc}", 1)
    except redis.RedisError as exc:
        return _fail(f"redis: {exc}", 1)
    except KeyboardInterrupt:
        return 130
