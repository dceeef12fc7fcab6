"""The argparse `type=` functions of lorafleet's flags: each turns one flag's text into its value or
refuses it with an ArgumentTypeError, which argparse reports as "argument --flag: <message>"."""

from __future__ import annotations

import argparse
import re

from shared.adapter_aliases import AliasVersion
from shared.adapter_registry import ADAPTER_NAME
from shared.config import ModelSpec


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def count(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return value


def port_or_off(text: str) -> int:
    """A TCP port, or 0 for "do not listen"."""
    if text.strip() == "0":
        return 0
    return port_number(text)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def device_name(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def adapter_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    bad = [name for name in names if not ADAPTER_NAME.match(name)]
    if bad:
        raise argparse.ArgumentTypeError(f"not an adapter name: {bad[0]!r} (expected NAME[,NAME...])")
    return tuple(dict.fromkeys(names))


def alias_version(text: str) -> AliasVersion:
    """`ADAPTER=WEIGHT`, one of an alias's weighted adapters."""
    name, sep, weight = text.rpartition("=")
    if not sep or not ADAPTER_NAME.match(name) or not weight.isdigit():
        raise argparse.ArgumentTypeError(f"expected ADAPTER=WEIGHT (an integer), got {text!r}")
    return AliasVersion(name, int(weight))


def model_spec(text: str) -> ModelSpec:
    try:
        spec = ModelSpec.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}") from None
    if not (spec.path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{spec.path} is not an HF model directory (it has no config.json)")
    return spec
