"""Helpers for the deploy tests: the files under deploy/, read as the tools that consume them would."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from unittest import mock

import pytest

from cli import flag_types
from cli.main import build_parser
from shared.config import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message} (compose's interpolation)
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, environment: dict[str, str]) -> str:
    """Compose's variable interpolation: `environment` first, then the default; a required variable
    that is missing fails the test with its message, as `docker compose` would refuse to start."""

    def substitute(match: re.Match[str]) -> str:
        name, operator, argument = match.groups()
        if name in environment:
            return environment[name]
        if operator is not None and operator.endswith("?"):
            pytest.fail(f"${{{name}}} is required: {argument}")
        return argument or ""

    return _VARIABLE.sub(substitute, text.replace("$$", "\0")).replace("\0", "$")


def _model_spec_syntax(text: str) -> ModelSpec:
    """`--model NAME=PATH` without the check that PATH holds a model: it is a path in the container."""
    try:
        return ModelSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_lorafleet_args(argv: list[str]) -> argparse.Namespace:
    """Parse `lorafleet ARGV` with the real command-line parser; a bad flag or value fails the test."""
    with mock.patch.object(flag_types, "model_spec", _model_spec_syntax):
        parser = build_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`lorafleet {' '.join(argv)}` does not parse (exit {exc.code})")
