"""Choosing a LoRA path and launch configurations from a tuned file, or the defaults without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernels.lora import configs
from kernels.lora.configs import ExpandConfig, FusedConfig, GatherConfig, Plan, default_plan, plan_for


@pytest.fixture
def tuned_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs._tuned_plans.cache_clear()
    plan_for.cache_clear()
    yield tmp_path
    configs._tuned_plans.cache_clear()
    plan_for.cache_clear()


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


def test_plans_survive_a_json_round_trip() -> None:
    plan = Plan(path="split", fused=FusedConfig(n_chunk=1024), expand=ExpandConfig(n_chunk=256), gather=GatherConfig())
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_a_chunk_must_hold_whole_column_tiles() -> None:
    with pytest.raises(ValueError, match="multiple of block_n"):
        ExpandConfig(block_n=128, n_chunk=200)
