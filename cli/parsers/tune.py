"""The parser of `tune`."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import commands, flag_types
from cli.parsers.common import ENGINE_DEFAULTS
from cli.state import DEFAULT_STATE_DIR


def add_tune(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="tune the LoRA kernels' plans for a model's shapes on this machine's GPU",
        description="Time the multi-LoRA kernels at the model's projection shapes on this machine's GPU and "
        "write the fastest plan per token bucket where workers look them up (kernels/lora/tuning/tuner.py "
        "describes the tuner). Every bucket asked for is tuned again, whatever the tables hold.",
    )
    tune.add_argument("--model", type=flag_types.model_spec, required=True, metavar="NAME=PATH", help="HF model dir")
    tune.add_argument(
        "--max-lora-rank",
        type=flag_types.positive_int,
        default=ENGINE_DEFAULTS.max_lora_rank,
        help="the workers' --max-lora-rank, whose padding keys the plans (default: %(default)s)",
    )
    tune.add_argument(
        "--tokens",
        type=flag_types.positive_int,
        nargs="+",
        help="token buckets (default: those a worker with the default --max-num-batched-tokens tunes)",
    )
    tune.add_argument("--budget-s", type=flag_types.seconds, help="stop after this many seconds (default: no limit)")
    where = tune.add_mutually_exclusive_group()
    where.add_argument("--kernel-plans-dir", type=Path, help="write here (default: STATE_DIR/kernel-plans)")
    where.add_argument("--state-dir", type=Path, help=f"write into its kernel-plans/ (default: {DEFAULT_STATE_DIR})")
    where.add_argument(
        "--packaged", action="store_true", help="write the packaged table, kernels/configs/<GPU>.json, to commit it"
    )
    tune.set_defaults(run=commands.tune)
