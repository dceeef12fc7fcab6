"""Whether `import kernels` (and our other top-level packages) finds lorafleet's own code.

Our packages have plain names, and one of them is taken on PyPI: Hugging Face's `kernels`, which
transformers >= 5.25 requires. Installed beside lorafleet, it can come first on the import path (a
console script's path starts at its bin directory, then site-packages), and the worker then fails
deep in an import with "No module named 'kernels.lora'". The entry point checks first and names the
package in the way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGES = ("cli", "gateway", "worker", "kernels", "shared")  # pyproject.toml's packages
ROOT = Path(__file__).resolve().parents[1]  # the directory that holds them all


def shadowed_packages() -> list[str]:
    """One line per package of ours that the import path resolves to another package's code: its name
    and where. A package not installed here (the gateway image ships no worker or kernels) is not
    shadowed: the command that needs it says so itself."""
    lines = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:  # absent, or a bare directory (a namespace package)
            continue
        found = Path(spec.origin).resolve().parent
        if found != ROOT / name:
            lines.append(f"`import {name}` finds {found}, not {ROOT / name}")
    return lines
