"""The floors of the code base, read from the source's import statements (every one, lazy and
type-only imports included): no import circle anywhere, and each floor imports only the ones under it.

    shared/, kernels/       the ground: nothing of the floors above
    worker/model/           the network: kernels/ and shared/ only
    worker/adapter_pool/    adapter formats and tiers: worker/model/ for the slot tensors, worker/metrics
    worker/engine/          requests to device steps: model, adapter pool, metrics
    gateway/ and worker/    meet only in shared/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "kernels", "worker", "gateway", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports: `from a.b import c` counts as a.b.c when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    found.discard(module_name(path))
    return {name for name in found if not ROOT.joinpath(*name.split("."), "__init__.py").is_file()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_imports_it_judges(graph: dict[str, set[str]]) -> None:
    assert "worker.model.model" in graph["worker.engine.model_runner"]
    assert "worker.adapter_pool.pool" in graph["worker.engine.engine"]


def test_no_module_imports_itself_through_others(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle_through_three_modules() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ALLOWED = {
    "shared": ("shared",),
    "kernels": ("kernels",),
    "worker.model": ("worker.model", "kernels", "shared"),
    "worker.adapter_pool": ("worker.adapter_pool", "worker.model", "worker.metrics", "worker.gpu_metrics", "shared"),
    "worker.engine": (
        "worker.engine",
        "worker.model",
        "worker.adapter_pool",
        "worker.metrics",
        "worker.gpu_metrics",
        "kernels",
        "shared",
    ),
    "gateway": ("gateway", "shared"),
}


@pytest.mark.parametrize("floor", list(ALLOWED))
def test_each_floor_imports_only_the_floors_under_it(graph: dict[str, set[str]], floor: str) -> None:
    allowed = ALLOWED[floor]
    wrong = {
        (module, target)
        for module, targets in graph.items()
        if module == floor or module.startswith(f"{floor}.")
        for target in targets
        if not any(target == a or target.startswith(f"{a}.") for a in allowed)
    }
    assert wrong == set()
