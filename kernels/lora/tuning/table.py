"""Writing a GPU's plan file (its format: kernels/lora/configs.py): tuned plans merged into what the
file holds, so that a tune interrupted or cut short keeps what it measured and several processes
tuning into one directory (one worker per GPU of a host) keep each other's plans (kernels/plan_files.py).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path

from kernels.lora.configs import Plan, PlanKey, plan_entry, read_plans, reload_plans
from kernels.plan_files import locked, read_document, replace_file


def update_plan_file(
    path: Path,
    device: str,
    command: str,
    plans: Mapping[tuple[PlanKey, int], Plan],
) -> int:
    """Merge `plans` ((shape, max_tokens) → plan) into the plan file at `path`, for GPU `device`,
    and list `command` among the commands that made it; returns how many plans the file holds.
    A bucket tuned again replaces its stored plan; the file's other buckets stay (a tune of one
    bucket completes a table rather than cutting it down). Read and rewritten under a lock on the
    directory, and replaced whole (no reader sees half a file); this process's next lookups read it
    again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path.parent):
        merged = read_plans(path) | dict(plans)
        commands = [c for c in read_document(path).get("commands", []) if c != command] + [command]
        document = {
            "device": device,
            "date": datetime.date.today().isoformat(),
            "commands": commands,
            "plans": [plan_entry(key, max_tokens, merged[key, max_tokens]) for key, max_tokens in sorted(merged)],
        }
        replace_file(path, json.dumps(document, indent=1) + "\n")
    reload_plans()
    return len(merged)
