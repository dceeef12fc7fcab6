"""The random-weight demo's files (the offline fallback), generated once per session into a temporary state
dir as `lorafleet up` does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.demo import ensure_random_demo
from shared.config import ModelSpec


@dataclass(frozen=True)
class DemoFiles:
    state_dir: Path
    adapter_root: Path
    model: ModelSpec


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> DemoFiles:
    state_dir = tmp_path_factory.mktemp("state")
    adapter_root = state_dir / "adapters"
    return DemoFiles(state_dir, adapter_root, ensure_random_demo(state_dir, adapter_root))


@pytest.fixture(autouse=True)
def no_ambient_fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run each test where no ./.lorafleet exists and without $REDIS_URL, so only its own flags count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
