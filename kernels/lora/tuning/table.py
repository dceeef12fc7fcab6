"""Writing a GPU's plan file (its format: kernels/lora/configs.py): tuned plans merged into what the
file holds, so that a tune interrupted or cut short keeps what it measured and several processes
tuning into one directory (one worker per GPU of a host) keep each other's plans (kernels/plan_files.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kernels.lora.configs import Plan, PlanKey, plan_entry, read_plans, reload_plans
from kernels.plan_files import merge_plans


def update_plan_file(
    path: Path,
    device: str,
    command: str,
    plans: Mapping[tuple[PlanKey, int], Plan],
) -> int:
    """Merge `plans` ((shape, max_tokens) → plan) into the plan file at `path`, for GPU `device`,
    and list `command` among the commands that made it; returns how many plans the file holds
    (kernels/plan_files.merge_plans); this process's next lookups read it again."""
    count = merge_plans(path, device, command, plans, read_plans, lambda key, plan: plan_entry(*key, plan))
    reload_plans()
    return count
