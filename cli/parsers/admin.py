"""The parsers of the admin commands: `tenant`, `adapter` and `alias`."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import commands, flag_types
from cli.parsers.common import ENGINE_DEFAULTS, add_redis_flags


def add_admin(subparsers: argparse._SubParsersAction) -> None:
    tenant = subparsers.add_parser("tenant", help="manage tenants").add_subparsers(dest="action", required=True)
    create = tenant.add_parser("create", help="create a tenant and print its API key (shown once)")
    create.add_argument("name")
    add_redis_flags(create)
    create.add_argument("--json", action="store_true", help='print {"tenant", "api_key"}')
    create.set_defaults(run=commands.tenant_create)

    adapter = subparsers.add_parser("adapter", help="manage adapters").add_subparsers(dest="action", required=True)
    register = adapter.add_parser("register", help="validate a PEFT LoRA adapter directory and register it")
    register.add_argument("name", help="the adapter's name in job requests")
    register.add_argument("--tenant", required=True, help="owning tenant, or 'shared' for every tenant")
    register.add_argument("--model", required=True, help="base model name")
    register.add_argument("--path", required=True, help="adapter dir under the tenant's directory, e.g. acme/support")
    register.add_argument("--adapter-root", type=Path, help="default: the running `up`'s")
    register.add_argument("--model-path", type=Path, help="the model's HF dir, if no worker has published it yet")
    register.add_argument(
        "--max-lora-rank",
        type=flag_types.positive_int,
        default=ENGINE_DEFAULTS.max_lora_rank,
        help="refuse larger ranks (default: %(default)s)",
    )
    add_redis_flags(register)
    register.add_argument("--json", action="store_true", help="print the adapter record")
    register.set_defaults(run=commands.adapter_register)

    alias = subparsers.add_parser("alias", help="manage adapter aliases (canaries, rollouts, rollbacks)")
    alias_actions = alias.add_subparsers(dest="action", required=True)
    alias_set = alias_actions.add_parser(
        "set", help="point an alias at weighted adapters; jobs submitted from now on draw by the new weights"
    )
    alias_set.add_argument("name", help="the alias's name in job requests")
    alias_set.add_argument("--tenant", required=True, help="owning tenant, or 'shared' for every tenant")
    alias_set.add_argument(
        "--adapter",
        dest="versions",
        action="append",
        required=True,
        type=flag_types.alias_version,
        metavar="ADAPTER=WEIGHT",
        help="a registered adapter and its weight (repeat: e.g. support-v2=95 support-v3=5; 0 keeps it listed, unused)",
    )
    add_redis_flags(alias_set)
    alias_set.add_argument("--json", action="store_true", help="print the alias")
    alias_set.set_defaults(run=commands.alias_set)
    alias_list = alias_actions.add_parser("list", help="every alias with its weights")
    add_redis_flags(alias_list)
    alias_list.set_defaults(run=commands.alias_list)
    alias_delete = alias_actions.add_parser("delete", help="remove an alias (jobs queued keep their adapter)")
    alias_delete.add_argument("name")
    add_redis_flags(alias_delete)
    alias_delete.set_defaults(run=commands.alias_delete)
