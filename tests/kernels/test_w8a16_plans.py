"""The W8A16 plan tables (kernels/quant/w8a16_plans.py): looked up by GPU, weight shape and token
bucket (the plan cache first, then the packaged table), the default plan without one; the files the
tuner writes and the committed ones; the tuner's candidates, each run through the interpreter
against the reference (kernels/quant/w8a16_tuning.py). The tuning itself needs a GPU."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels.lora.configs import set_plan_cache_dir
from kernels.plan_files import PACKAGED_DIR
from kernels.quant import w8a16_plans
from kernels.quant.reference import weight_only_linear_reference
from kernels.quant.w8a16 import w8a16_linear
from kernels.quant.w8a16_plans import W8A16Plan, config_file, default_plan, plan_for, read_plans, tuned_plan
from kernels.quant.w8a16_tuning import (
    TOKEN_BUCKETS,
    candidates,
    fits_shared_memory,
    matches,
    refinements,
    tune_cells,
    update_plan_file,
)
from tests.kernels.test_w8a16 import assert_within_rounding, operands

GPU = "Test GPU"
STREAM = W8A16Plan(16, 32, 256, 1, num_warps=8, num_stages=5, swap=True)
MMA = W8A16Plan(64, 128, 128, 2, num_warps=4, num_stages=3, swap=True)
PLAN_FIELDS = {field.name for field in dataclasses.fields(W8A16Plan)}


@pytest.fixture
def packaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty packaged directory and no plan cache."""
    directory = tmp_path / "packaged"
    directory.mkdir()
    monkeypatch.setattr(w8a16_plans, "PACKAGED_DIR", directory)
    set_plan_cache_dir(None)
    w8a16_plans.reload_plans()
    yield directory
    set_plan_cache_dir(None)
    w8a16_plans.reload_plans()


def test_a_gemm_takes_the_smallest_bucket_that_holds_its_tokens(packaged: Path) -> None:
    update_plan_file(config_file(GPU), GPU, "tune", {(6144, 4096, 8): STREAM, (6144, 4096, 64): MMA})
    assert plan_for(GPU, 1, 6144, 4096, num_sms=132) == STREAM
    assert plan_for(GPU, 8, 6144, 4096, num_sms=132) == STREAM
    assert plan_for(GPU, 9, 6144, 4096, num_sms=132) == MMA
    assert plan_for(GPU, 500, 6144, 4096, num_sms=132) == MMA  # past every bucket: the largest


def test_shapes_and_gpus_without_a_plan_take_the_default(packaged: Path) -> None:
    update_plan_file(config_file(GPU), GPU, "tune", {(6144, 4096, 8): STREAM})
    assert tuned_plan(GPU, 8, 4096, 4096) is None
    assert plan_for(GPU, 8, 4096, 4096, num_sms=132) == default_plan(8, 4096, 4096, num_sms=132)
    assert plan_for("Other GPU", 8, 6144, 4096, num_sms=100) == default_plan(8, 6144, 4096, num_sms=100)


def test_a_cached_plan_wins_for_its_cell_and_the_packaged_buckets_still_serve(packaged: Path, tmp_path: Path) -> None:
    update_plan_file(config_file(GPU), GPU, "packaged", {(6144, 4096, 8): STREAM, (6144, 4096, 64): MMA})
    assert plan_for(GPU, 4, 6144, 4096, num_sms=132) == STREAM  # looked up before the cache is set
    cache = tmp_path / "cache"
    set_plan_cache_dir(cache)
    cached = dataclasses.replace(STREAM, split_k=4)
    update_plan_file(config_file(GPU, cache), GPU, "worker", {(6144, 4096, 8): cached})
    assert plan_for(GPU, 4, 6144, 4096, num_sms=132) == cached
    assert plan_for(GPU, 40, 6144, 4096, num_sms=132) == MMA


def test_the_tuners_file_merges_cells_and_lists_its_commands(packaged: Path) -> None:
    path = config_file(GPU)
    update_plan_file(path, GPU, "first", {(6144, 4096, 8): STREAM, (4096, 4096, 8): STREAM})
    total = update_plan_file(path, GPU, "second", {(6144, 4096, 8): MMA, (6144, 4096, 64): MMA})
    assert total == 3
    assert read_plans(path) == {(6144, 4096, 8): MMA, (4096, 4096, 8): STREAM, (6144, 4096, 64): MMA}
    document = json.loads(path.read_text())
    assert (document["device"], document["commands"]) == (GPU, ["first", "second"])
    assert path.name == "w8a16_Test_GPU.json"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"n": 64, "k": 64, "max_tokens": 8, "block_m": 16, "block_n": 48, "block_k": 64, "split_k": 1,
          "num_warps": 4, "num_stages": 2}, "block_n 48"),
        ({"n": 64, "k": 64, "max_tokens": 8, "block_m": 16, "block_n": 64, "block_k": 64, "split_k": 0,
          "num_warps": 4, "num_stages": 2}, "split_k 0"),
        ({"n": 64, "k": 64, "max_tokens": 8, "block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4,
          "num_stages": 2}, "split_k"),
        ({"n": 64, "k": 64, "max_tokens": 8, "block_m": 16, "block_n": 64, "block_k": 64, "split_k": 1,
          "num_warps": 4, "num_stages": 2, "group": 8}, "group"),
    ],
)  # fmt: skip
def test_a_file_with_a_bad_plan_is_refused_naming_it_and_the_field(
    packaged: Path, entry: dict[str, object], message: str
) -> None:
    path = config_file(GPU)
    path.write_text(json.dumps({"device": GPU, "date": "2026-11-26", "commands": [], "plans": [entry]}))
    with pytest.raises(ValueError, match=message) as raised:
        read_plans(path)
    assert str(path) in str(raised.value)


def test_a_file_that_is_not_json_is_refused_naming_it(packaged: Path) -> None:
    path = config_file(GPU)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the W8A16 plan file"):
        read_plans(path)


def committed_tables() -> list[Path]:
    return sorted(PACKAGED_DIR.glob("w8a16_*.json"))


@pytest.mark.parametrize("path", committed_tables(), ids=lambda path: path.name)
def test_a_committed_table_is_complete_for_its_gpu(path: Path) -> None:
    document = json.loads(path.read_text())
    assert set(document) == {"device", "date", "commands", "plans"}
    assert path.name == f"w8a16_{document['device'].replace(' ', '_')}.json"
    assert document["commands"] and all(c.startswith("python -m bench.tune_w8a16") for c in document["commands"])
    for entry in document["plans"]:
        assert set(entry) == {"n", "k", "max_tokens"} | PLAN_FIELDS
    plans = read_plans(path)
    assert len(plans) == len(document["plans"])  # no cell listed twice
    for (_, _, max_tokens), plan in plans.items():
        assert max_tokens in TOKEN_BUCKETS and fits_shared_memory(plan)


@pytest.mark.parametrize("num_tokens", TOKEN_BUCKETS)
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_candidates_cover_both_operand_orders_when_streaming_and_keep_the_tokens_in_one_tile(
    num_tokens: int, n: int, k: int
) -> None:
    plans = candidates(num_tokens, n, k, num_sms=132)
    assert len(plans) == len(set(plans)) and 4 <= len(plans) <= 20
    assert {plan.swap for plan in plans} == ({False, True} if num_tokens <= 16 else {True})
    for plan in plans:
        assert plan.block_m == default_plan(num_tokens, n, k, num_sms=132).block_m >= min(num_tokens, 64)
        assert plan.split_k == 1 or k // plan.split_k >= 2 * plan.block_k  # two K steps a split at least
        assert plan.split_k == 1 or -(-n // plan.block_n) * plan.split_k <= 6 * 132  # a split only to fill SMs
        for variant in refinements(plan):
            assert dataclasses.replace(variant, num_warps=plan.num_warps, num_stages=plan.num_stages) == plan


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 40])
def test_every_candidate_computes_the_product(num_tokens: int) -> None:
    # a GPU of 2 SMs, so that even these small shapes are given K splits to try
    n, k = 96, 1024
    x, q, scales, _ = operands(num_tokens, n, k, torch.float16, seed=num_tokens)
    plans = candidates(num_tokens, n, k, num_sms=2)
    assert any(plan.split_k > 1 for plan in plans)
    for plan in plans:
        assert_within_rounding(w8a16_linear(x, q, scales, plan=plan), x, q, scales, None)


def test_the_tuners_check_refuses_a_product_missing_part_of_k() -> None:
    x, q, scales, _ = operands(8, 64, 512, torch.float16, seed=5)
    y = w8a16_linear(x, q, scales, plan=candidates(8, 64, 512, num_sms=2)[0])
    reference = weight_only_linear_reference(x.float(), q, scales)
    assert matches(y, reference)
    cut = q.clone()
    cut[:, 448:] = 0  # the last of eight 64-wide K steps dropped
    assert not matches(y, weight_only_linear_reference(x.float(), cut, scales))


@pytest.mark.gpu
def test_tuned_cells_land_in_the_file_and_in_the_lookup(packaged: Path) -> None:
    device = torch.cuda.get_device_name()
    cells = [(1024, 2048, 1), (1024, 2048, 32)]
    run = tune_cells(cells, config_file(device), device_name=device, command="test")
    assert [r.key for r in run.results] == cells and not run.not_reached
    for r in run.results:
        assert r.us <= r.default_us and r.timed > 1
        assert plan_for(device, r.num_tokens, r.n, r.k, num_sms=1) == r.plan
    assert set(read_plans(config_file(device))) == set(cells)


@pytest.mark.gpu
def test_a_spent_budget_tunes_nothing_and_says_what_it_did_not_reach(packaged: Path) -> None:
    device = torch.cuda.get_device_name()
    run = tune_cells([(1024, 2048, 8)], config_file(device), device_name=device, command="test", budget_s=0)
    assert run.results == () and run.not_reached == ((1024, 2048, 8),)
    assert not config_file(device).exists()
