"""Choosing a LoRA path and launch configurations from the tuned files (the plan cache first, then the
packaged tables), or the defaults without one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels.lora import configs
from kernels.lora.configs import (
    ExpandConfig,
    FusedConfig,
    GatherConfig,
    Plan,
    default_plan,
    plan_for,
    read_plans,
    set_plan_cache_dir,
)


@pytest.fixture
def tuned_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty packaged directory and no plan cache."""
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(configs, "PACKAGED_DIR", packaged)
    set_plan_cache_dir(None)
    yield packaged
    set_plan_cache_dir(None)


@pytest.fixture
def cache_dir(tuned_dir: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "cache"
    directory.mkdir()
    set_plan_cache_dir(directory)
    return directory


def write_plans(directory: Path, device: str, plans: list[dict]) -> None:
    document = {"device": device, "date": "2026-11-21", "commands": [], "plans": plans}
    (directory / f"{device.replace(' ', '_')}.json").write_text(json.dumps(document))


def entry(max_tokens: int, path: str, **shape: object) -> dict:
    return {"k": 64, "widths": [32, 16], "rank_pad": 16, "max_tokens": max_tokens} | shape | Plan(path=path).to_json()


def test_a_batch_takes_the_smallest_bucket_that_holds_it(tuned_dir: Path) -> None:
    write_plans(tuned_dir, "Test GPU", [entry(8, "overlap"), entry(256, "split"), entry(32, "fused")])
    assert plan_for("Test GPU", 64, (32, 16), 16, 1).path == "overlap"
    assert plan_for("Test GPU", 64, (32, 16), 16, 9).path == "fused"
    assert plan_for("Test GPU", 64, (32, 16), 16, 200).path == "split"


def test_a_batch_past_every_bucket_takes_the_largest(tuned_dir: Path) -> None:
    write_plans(tuned_dir, "Test GPU", [entry(8, "overlap"), entry(256, "split")])
    assert plan_for("Test GPU", 64, (32, 16), 16, 5000).path == "split"


def test_unknown_gpus_and_shapes_fall_back_to_the_defaults(tuned_dir: Path) -> None:
    write_plans(tuned_dir, "Test GPU", [entry(8, "fused")])
    assert plan_for("Other GPU", 64, (32, 16), 16, 4) == default_plan(4, 16)
    assert plan_for("Test GPU", 64, (32, 16), 64, 4) == default_plan(4, 64)


def test_a_cached_plan_wins_over_the_packaged_one_of_its_shape_and_bucket(tuned_dir: Path, cache_dir: Path) -> None:
    write_plans(tuned_dir, "Test GPU", [entry(8, "overlap"), entry(256, "split")])
    write_plans(cache_dir, "Test GPU", [entry(8, "fused")])
    assert plan_for("Test GPU", 64, (32, 16), 16, 4).path == "fused"
    assert plan_for("Test GPU", 64, (32, 16), 16, 100).path == "split"  # the packaged buckets still serve


def test_the_cache_fills_in_buckets_and_shapes_the_packaged_table_lacks(tuned_dir: Path, cache_dir: Path) -> None:
    write_plans(tuned_dir, "Test GPU", [entry(256, "split")])
    write_plans(cache_dir, "Test GPU", [entry(8, "fused"), entry(8, "overlap", k=128)])
    assert plan_for("Test GPU", 64, (32, 16), 16, 4).path == "fused"
    assert plan_for("Test GPU", 64, (32, 16), 16, 9).path == "split"
    assert plan_for("Test GPU", 128, (32, 16), 16, 4).path == "overlap"


def test_setting_the_cache_dir_forgets_earlier_lookups(tuned_dir: Path, tmp_path: Path) -> None:
    write_plans(tuned_dir, "Test GPU", [entry(8, "split")])
    assert plan_for("Test GPU", 64, (32, 16), 16, 4).path == "split"
    write_plans(tmp_path, "Test GPU", [entry(8, "fused")])
    set_plan_cache_dir(tmp_path)
    assert plan_for("Test GPU", 64, (32, 16), 16, 4).path == "fused"
    set_plan_cache_dir(None)
    assert plan_for("Test GPU", 64, (32, 16), 16, 4).path == "split"


def test_an_unreadable_plan_file_is_an_error_naming_it(tuned_dir: Path) -> None:
    (tuned_dir / "Test_GPU.json").write_text('{"plans": [{"k": 64}]}')
    with pytest.raises(ValueError, match=r"Test_GPU\.json is not a LoRA plan file"):
        plan_for("Test GPU", 64, (32, 16), 16, 4)
    (tuned_dir / "Test_GPU.json").write_text("{half a")
    with pytest.raises(ValueError, match=r"cannot read the LoRA plan file .*Test_GPU\.json"):
        read_plans(tuned_dir / "Test_GPU.json")


def test_plans_survive_a_json_round_trip() -> None:
    plan = Plan(path="split", fused=FusedConfig(n_chunk=1024), expand=ExpandConfig(n_chunk=256), gather=GatherConfig())
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_a_chunk_must_hold_whole_column_tiles() -> None:
    with pytest.raises(ValueError, match="multiple of block_n"):
        ExpandConfig(block_n=128, n_chunk=200)
