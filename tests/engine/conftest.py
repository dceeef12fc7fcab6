"""Tiny HF checkpoints, built once per session and shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.engine.tiny_hf import FAMILIES, TinyCheckpoint, build_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyCheckpoint]:
    """family → its TinyCheckpoint, built on first use."""
    built: dict[str, TinyCheckpoint] = {}

    def get(family: str) -> TinyCheckpoint:
        if family not in built:
            built[family] = build_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(params=list(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoints: Callable[[str], TinyCheckpoint]) -> TinyCheckpoint:
    """Each supported family in turn."""
    return tiny_checkpoints(request.param)


@pytest.fixture
def llama(tiny_checkpoints: Callable[[str], TinyCheckpoint]) -> TinyCheckpoint:
    return tiny_checkpoints("llama")
