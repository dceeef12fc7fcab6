"""Where tuned plan files are (the packaged kernels/configs/, and the process's plan cache directory,
searched first), and rewriting one safely: under an exclusive lock on its directory, replaced whole,
so that no reader sees half a file and several processes tuning into one directory (one worker per
GPU of a host) keep each other's plans. The formats are their tables' own (kernels/lora/configs.py,
kernels/quant/w8a16_plans.py; kernels/moe/configs.py reads the packaged directory only).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

Key = TypeVar("Key")  # a table's plan key: sortable, and what its reader maps plans by
Value = TypeVar("Value")

PACKAGED_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(slots=True)
class _Search:
    cache_dir: Path | None = None  # searched before PACKAGED_DIR


_search = _Search()


def set_cache_dir(directory: Path | None) -> None:
    """The directory of plans tuned on this machine (None: the packaged ones only). Callers set it
    through kernels.lora.configs.set_plan_cache_dir, which also forgets the LoRA lookups made before;
    the W8A16 lookups are keyed by it."""
    _search.cache_dir = directory


def cache_dir() -> Path | None:
    return _search.cache_dir


def read_document(path: Path) -> dict[str, Any]:
    """The JSON object a plan file holds; an empty one for a file that does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def read_entries(path: Path, table: str) -> list[dict[str, Any]]:
    """The plan entries a plan file lists, for its table's reader to parse; none for a file that does
    not exist. A file that cannot be read, or holds no list of plans, raises ValueError naming it and
    its `table` ("LoRA", "W8A16")."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the {table} plan file {path}: {exc}") from exc
    entries = document.get("plans") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path} is not a {table} plan file: it holds no list of plans")
    return entries


def replace_file(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path` (atomic)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on the directory itself: the file it guards is replaced, not rewritten,
    so a lock on the file would guard a name that moves."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def merge_plans(
    path: Path,
    device: str,
    command: str,
    plans: Mapping[Key, Value],
    read: Callable[[Path], Mapping[Key, Value]],
    entry: Callable[[Key, Value], dict[str, Any]],
) -> int:
    """Merge `plans` into the plan file at `path` (its table's reader `read`, each plan written by
    `entry`), for GPU `device`, and list `command` among the commands that made it; returns how many
    plans the file holds. A key tuned again replaces its plan; the file's others stay (a tune cut short
    completes a table rather than cutting it down). Under the directory's lock, replaced whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path.parent):
        merged = dict(read(path)) | dict(plans)
        commands = [c for c in read_document(path).get("commands", []) if c != command] + [command]
        document = {
            "device": device,
            "date": datetime.date.today().isoformat(),
            "commands": commands,
            "plans": [entry(key, merged[key]) for key in sorted(merged)],
        }
        replace_file(path, json.dumps(document, indent=1) + "\n")
    return len(merged)
