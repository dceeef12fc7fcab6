"""Fixtures of the reliability suite: the demo model and adapters on disk, and a fleet of real processes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from cli.demo_adapters import DEMO_ADAPTERS, write_demo_adapter
from cli.demo_model import write_demo_model
from shared.model_info import ModelInfo
from tests.reliability.fleet import MODEL, Fleet, provision


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, adapter root): the demo model and its tenants' adapters, as `lorafleet up` writes them."""
    root = tmp_path_factory.mktemp("demo")
    model_dir, adapter_root = root / "model", root / "adapters"
    model_dir.mkdir()
    write_demo_model(model_dir)
    info = ModelInfo.from_pretrained(MODEL, model_dir)
    for adapter in DEMO_ADAPTERS:
        (adapter_root / adapter.path).mkdir(parents=True)
        write_demo_adapter(adapter_root / adapter.path, adapter, info, model_dir)
    return model_dir, adapter_root


def open_fleet(redis_url: str, assets: tuple[Path, Path], log_dir: Path, stack: ExitStack) -> Fleet:
    model_dir, adapter_root = assets
    fleet = Fleet(redis_url, model_dir, adapter_root, log_dir, stack)
    fleet.api_keys = provision(redis_url, model_dir, adapter_root)
    return fleet


@pytest.fixture
def fleet(redis_url: str, demo_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[Fleet]:
    """Tenants and adapters registered in the session's Redis; no process started yet."""
    with ExitStack() as stack:
        yield open_fleet(redis_url, demo_assets, tmp_path, stack)
