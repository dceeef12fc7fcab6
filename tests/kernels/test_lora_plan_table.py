"""Writing tuned plans into a GPU's plan file: merged with what it holds, replaced whole, seen by the
next lookup."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels.lora import configs
from kernels.lora.configs import PACKAGED_DIR, Plan, config_file, plan_for, read_plans, set_plan_cache_dir
from kernels.lora.tuning import update_plan_file

SHAPE = (64, (32, 16), 16)
OTHER = (128, (64,), 16)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(configs, "PACKAGED_DIR", tmp_path / "packaged")
    set_plan_cache_dir(tmp_path / "cache")
    yield tmp_path / "cache"
    set_plan_cache_dir(None)


def test_tuned_plans_join_the_files_others(cache_dir: Path) -> None:
    path = config_file("Test GPU", cache_dir)
    update_plan_file(path, "Test GPU", "first", {(SHAPE, 8): Plan("fused"), (OTHER, 8): Plan("split")})
    total = update_plan_file(path, "Test GPU", "second", {(SHAPE, 8): Plan("overlap"), (SHAPE, 64): Plan("split")})
    assert total == 3
    assert read_plans(path) == {(SHAPE, 8): Plan("overlap"), (SHAPE, 64): Plan("split"), (OTHER, 8): Plan("split")}
    document = json.loads(path.read_text())
    assert (document["device"], document["commands"]) == ("Test GPU", ["first", "second"])


def test_a_shape_tuned_again_from_scratch_drops_its_old_buckets(cache_dir: Path) -> None:
    path = config_file("Test GPU", cache_dir)
    update_plan_file(path, "Test GPU", "first", {(SHAPE, 8): Plan("fused"), (SHAPE, 64): Plan("fused")})
    update_plan_file(path, "Test GPU", "first", {(SHAPE, 8): Plan("split")}, replace_shapes={SHAPE})
    assert read_plans(path) == {(SHAPE, 8): Plan("split")}
    assert json.loads(path.read_text())["commands"] == ["first"]  # listed once, last


def test_the_writing_process_sees_its_plans_at_the_next_lookup(cache_dir: Path) -> None:
    assert plan_for("Test GPU", *SHAPE, 4).path != "fused"
    update_plan_file(config_file("Test GPU", cache_dir), "Test GPU", "tune", {(SHAPE, 8): Plan("fused")})
    assert plan_for("Test GPU", *SHAPE, 4).path == "fused"


def test_concurrent_writers_keep_each_others_plans(cache_dir: Path) -> None:
    path = config_file("Test GPU", cache_dir)
    writers = [
        threading.Thread(
            target=lambda t=t: [
                update_plan_file(path, "Test GPU", f"w{t}", {((64, (32, 16), 16), t * 100 + i): Plan("split")})
                for i in range(10)
            ]
        )
        for t in range(4)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert len(read_plans(path)) == 40
    assert [p.name for p in cache_dir.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("table", sorted(p.name for p in PACKAGED_DIR.glob("NVIDIA_*.json")))
def test_rewriting_a_committed_table_keeps_every_plan_as_it_was(table: str, tmp_path: Path) -> None:
    path = tmp_path / table
    shutil.copy(PACKAGED_DIR / table, path)
    before = json.loads(path.read_text())
    update_plan_file(path, before["device"], before["commands"][-1], {})
    after = json.loads(path.read_text())
    assert after["plans"] == before["plans"]
    assert after["commands"] == before["commands"]
