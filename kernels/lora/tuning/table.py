"""Writing a GPU's plan file (its format: kernels/lora/configs.py): tuned plans merged into what the
file holds, so that a tune interrupted or cut short keeps what it measured and several processes
tuning into one directory (one worker per GPU of a host) keep each other's plans.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import tempfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from kernels.lora.configs import Plan, PlanKey, plan_entry, read_plans, reload_plans


def update_plan_file(
    path: Path,
    device: str,
    command: str,
    plans: Mapping[tuple[PlanKey, int], Plan],
    *,
    replace_shapes: Collection[PlanKey] = (),
) -> int:
    """Merge `plans` ((shape, max_tokens) → plan) into the plan file at `path`, for GPU `device`,
    and list `command` among the commands that made it; returns how many plans the file holds.
    The file's plans of `replace_shapes` not in `plans` are dropped (a shape tuned again from scratch).
    Read and rewritten under a lock on the directory, and replaced whole (no reader sees half a file);
    this process's next lookups read it again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        merged = {
            (key, max_tokens): plan for (key, max_tokens), plan in read_plans(path).items() if key not in replace_shapes
        }
        merged |= plans
        commands = [c for c in _read_document(path).get("commands", []) if c != command] + [command]
        document = {
            "device": device,
            "date": datetime.date.today().isoformat(),
            "commands": commands,
            "plans": [plan_entry(key, max_tokens, merged[key, max_tokens]) for key, max_tokens in sorted(merged)],
        }
        _replace(path, json.dumps(document, indent=1) + "\n")
    reload_plans()
    return len(merged)


def _read_document(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _replace(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on the directory itself: the file it guards is replaced, not rewritten,
    so a lock on the file would guard a name that moves."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)
