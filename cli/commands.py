"""What each command runs: its config built from the flags, handed to the code that does the work.

Each imports its heavy dependencies (torch through the worker, aiohttp through the gateway) only
when it runs. Only the long-running processes (up, gateway, worker) configure logging.
"""

from __future__ import annotations

import argparse

from cli import config_from_args as cfa
from cli.errors import CommandError
from shared.log import configure_logging


def up(args: argparse.Namespace) -> int:
    from cli.up import run_up

    configure_logging("up", level=args.log_level)
    return run_up(cfa.up_config(args))


def gateway(args: argparse.Namespace) -> int:
    from gateway.main import run_gateway

    configure_logging("gateway", level=args.log_level, batched=True)
    run_gateway(cfa.gateway_config(args))
    return 0


def worker(args: argparse.Namespace) -> int:
    from worker.main import run_worker
    from worker.memory_plan import MemoryPlanError

    configure_logging("worker", level=args.log_level)
    try:
        return run_worker(cfa.worker_config(args))
    except MemoryPlanError as exc:  # a configuration the device cannot hold: the message names the settings
        raise CommandError(str(exc), exit_code=2) from exc


def tune(args: argparse.Namespace) -> int:
    from cli.tune import run_tune

    return run_tune(cfa.tune_config(args))


def quantize(args: argparse.Namespace) -> int:
    from cli.quantize import run_quantize

    return run_quantize(cfa.quantize_config(args))


def tenant_create(args: argparse.Namespace) -> int:
    from cli import admin

    return admin.tenant_create(cfa.redis_url(args), args.name, as_json=args.json)


def adapter_register(args: argparse.Namespace) -> int:
    from cli import admin

    return admin.adapter_register(cfa.redis_url(args), cfa.adapter_registration(args), as_json=args.json)


def alias_set(args: argparse.Namespace) -> int:
    from cli import admin

    return admin.alias_set(cfa.redis_url(args), args.name, args.tenant, args.versions, as_json=args.json)


def alias_list(args: argparse.Namespace) -> int:
    from cli import admin

    return admin.alias_list(cfa.redis_url(args))


def alias_delete(args: argparse.Namespace) -> int:
    from cli import admin

    return admin.alias_delete(cfa.redis_url(args), args.name)


def submit(args: argparse.Namespace) -> int:
    from cli.submit import submit as submit_prompt

    body = {
        name: value
        for name, value in (
            ("model", args.model),
            ("adapter", args.adapter),
            ("prompt", args.prompt),
            ("max_tokens", args.max_tokens),
            ("temperature", args.temperature),
            ("seed", args.seed),
        )
        if value is not None
    }
    return submit_prompt(cfa.submit_target(args), body, timeout_s=args.timeout, as_json=args.json)


def batch_submit(args: argparse.Namespace) -> int:
    from cli.batch import submit_batch

    model = args.model if args.adapter is None else f"{args.model}:{args.adapter}"
    return submit_batch(cfa.submit_target(args), args.file, model, wait=not args.no_wait, timeout_s=args.timeout)


def batch_get(args: argparse.Namespace) -> int:
    from cli.batch import get_batch

    return get_batch(cfa.submit_target(args), args.batch_id, args.output, args.errors)
