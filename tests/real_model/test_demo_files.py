"""What `lorafleet up` puts in a state dir for the demo: SmolLM2 converted once and the committed
trained adapters in the tenants' directories; offline, the random-weight demo after one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors import safe_open

from cli.demo import SMOLLM2_MODEL, ensure_demo_files
from cli.demo_adapters import DEMO_ADAPTERS
from shared.adapter_format import WEIGHTS_FILE, read_adapter
from shared.model_info import ModelInfo


def test_the_demo_is_smollm2_with_small_trained_adapters_made_once(tmp_path: Path, smollm2_wheel: Path) -> None:
    state_dir, adapter_root = tmp_path / "state", tmp_path / "state" / "adapters"
    spec = ensure_demo_files(state_dir, adapter_root)

    assert spec.name == SMOLLM2_MODEL
    info = ModelInfo.from_pretrained(spec.name, spec.path)
    for adapter in DEMO_ADAPTERS:
        path = adapter.path(SMOLLM2_MODEL)
        adapter_dir = adapter_root / path
        manifest = read_adapter(adapter_root, path, info, max_rank=64, max_bytes=1 << 30).manifest
        assert manifest.rank == 8 and set(manifest.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
        assert (adapter_dir / WEIGHTS_FILE).stat().st_size < 2_000_000
        with safe_open(adapter_dir / WEIGHTS_FILE, "pt") as weights:
            assert {str(weights.get_slice(name).get_dtype()) for name in weights.keys()} == {"BF16"}  # noqa: SIM118

    files = {p: p.stat().st_mtime_ns for p in state_dir.rglob("*") if p.is_file()}
    assert ensure_demo_files(state_dir, adapter_root) == spec
    assert {p: p.stat().st_mtime_ns for p in state_dir.rglob("*") if p.is_file()} == files


def test_offline_the_demo_falls_back_to_random_weights_saying_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured index or local wheel directory
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port

    spec = ensure_demo_files(tmp_path / "state", tmp_path / "state" / "adapters")

    assert spec.name == "demo"
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if not line.startswith("fetching")] == [
        next(line for line in lines if line.startswith("cannot fetch the demo model ("))
    ]
    assert lines[-1].endswith("): serving a random-weight model instead")
    assert not (tmp_path / "state" / "models" / SMOLLM2_MODEL).exists()
