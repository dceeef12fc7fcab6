"""The parsers of the gateway's clients: `submit` and `batch`."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import commands, flag_types
from cli.parsers.common import add_target_flags
from cli.state import DEFAULT_STATE_DIR


def add_submit(subparsers: argparse._SubParsersAction) -> None:
    submit = subparsers.add_parser("submit", help="run one prompt through the gateway and print the output")
    submit.add_argument("prompt")
    submit.add_argument("--url", help="gateway URL (default: the running `up`'s)")
    submit.add_argument("--api-key", help="tenant API key")
    submit.add_argument("--state-dir", type=Path, help=f"a running `up`'s state dir (default: {DEFAULT_STATE_DIR})")
    submit.add_argument("--tenant", help="demo tenant whose key to take from STATE_DIR/demo.json")
    submit.add_argument("--model", required=True)
    submit.add_argument("--adapter")
    submit.add_argument("--max-tokens", type=flag_types.positive_int)
    submit.add_argument("--temperature", type=float)
    submit.add_argument("--seed", type=int)
    submit.add_argument(
        "--timeout", type=float, default=300.0, help="give up waiting after this many seconds (default: %(default)s)"
    )
    submit.add_argument("--json", action="store_true", help="print the whole job record")
    submit.set_defaults(run=commands.submit)


def add_batch(subparsers: argparse._SubParsersAction) -> None:
    batch = subparsers.add_parser("batch", help="run a JSONL file of requests as a batch (the OpenAI Batch API)")
    actions = batch.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="upload FILE, start its batch, follow it with a progress bar")
    submit.add_argument("file", type=Path, help="JSONL: OpenAI batch lines, or request bodies (prompt or messages)")
    submit.add_argument("--model", required=True)
    submit.add_argument("--adapter", help="run every line with this adapter")
    submit.add_argument("--no-wait", action="store_true", help="print the batch id and return at once")
    submit.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds to follow it (default: 24 h)")
    add_target_flags(submit)
    submit.set_defaults(run=commands.batch_submit)
    get = actions.add_parser("get", help="write a finished batch's output lines to --output")
    get.add_argument("batch_id")
    get.add_argument("--output", type=Path, required=True, help="where the output JSONL goes")
    get.add_argument("--errors", type=Path, help="where the error JSONL goes (default: not written)")
    add_target_flags(get)
    get.set_defaults(run=commands.batch_get)
