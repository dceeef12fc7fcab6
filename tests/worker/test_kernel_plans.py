"""What a worker tunes at start: its models' LoRA projection shapes (as the engine builds them), the
token buckets its steps can take, and which of them this GPU's tables lack; for a model served in
fp8, its W8A16 GEMMs' weight shapes and decode buckets alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kernels.lora import configs
from kernels.lora.configs import Plan, config_file, set_plan_cache_dir
from kernels.lora.tiles import rank_pad
from kernels.lora.tuning import ProjectionShape, update_plan_file
from kernels.quant import w8a16_plans
from kernels.quant.w8a16_plans import W8A16Plan
from kernels.quant.w8a16_tuning import TOKEN_BUCKETS as W8A16_BUCKETS
from kernels.quant.w8a16_tuning import update_plan_file as update_w8a16_file
from shared.config import EngineConfig
from shared.model_info import ModelInfo
from worker import kernel_plans
from worker.kernel_plans import (
    TOKEN_LADDER,
    adapted_layer,
    ensure_tuned,
    ensure_w8a16_tuned,
    missing_buckets,
    missing_w8a16_cells,
    plan_keys,
    pool_rank,
    token_buckets,
    tune_at_start,
    w8a16_cells,
)
from worker.model.model import CausalLM

DENSE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], **DENSE},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], **DENSE},
    "mixtral": {"architectures": ["MixtralForCausalLM"], **DENSE, "num_local_experts": 4, "num_experts_per_tok": 2},
    # q heads wider than the hidden size (head_dim 32 x 4 heads = 128 > 64), as Qwen3-30B-A3B's are
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], **DENSE, "head_dim": 32, "moe_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe_dense_first": {"architectures": ["Qwen3MoeForCausalLM"], **DENSE, "head_dim": 32,
                              "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                              "mlp_only_layers": [0]},
}  # fmt: skip
ATTENTION = (ProjectionShape("qkv", 64, (64, 32, 32)), ProjectionShape("o", 64, (64,)))
MLP = (ProjectionShape("gate_up", 64, (96, 96)), ProjectionShape("down", 96, (64,)))
QWEN3_ATTENTION = (ProjectionShape("qkv", 64, (128, 64, 64)), ProjectionShape("o", 128, (64,)))


def model_info(tmp_path: Path, family: str) -> ModelInfo:
    directory = tmp_path / family
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIGS[family]))
    return ModelInfo.from_pretrained(family, directory)


@pytest.mark.parametrize(
    ("family", "projections", "qk_norm", "head_dim"),
    [
        ("llama", ATTENTION + MLP, False, 16),
        ("qwen2", ATTENTION + MLP, False, 16),
        ("mixtral", ATTENTION, False, 16),
        ("qwen3_moe", QWEN3_ATTENTION, True, 32),
        ("qwen3_moe_dense_first", QWEN3_ATTENTION + MLP, True, 32),
    ],
)
def test_a_models_adapted_layer_comes_from_its_config(
    tmp_path: Path, family: str, projections: tuple, qk_norm: bool, head_dim: int
) -> None:
    shapes = adapted_layer(model_info(tmp_path, family), max_lora_rank=64)
    assert shapes.projections == projections
    assert (shapes.qk_norm, shapes.head_dim) == (qk_norm, head_dim)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("max_lora_rank", [8, 16, 24, 64])
def test_the_tuned_keys_are_what_the_engines_layers_look_up(tmp_path: Path, family: str, max_lora_rank: int) -> None:
    info = model_info(tmp_path, family)
    model = CausalLM(info, max_loras=2, max_lora_rank=max_lora_rank, device="meta")
    # kernels.lora.plan_for_batch: K, slice widths, the padded rank of pages_per_slot pages of PR rows
    looked_up = {
        (linear.in_features, linear.out_features, rank_pad(model.pages_per_slot * linear.lora_a[0].shape[1]))
        for layer in model.model.layers
        for linear in layer.lora_linears()
    }
    shapes = adapted_layer(info, max_lora_rank)
    assert set(plan_keys(shapes, pool_rank(info, max_lora_rank))) == looked_up
    assert shapes.page_rank == model.page_rank


def test_buckets_reach_the_largest_step_and_no_further() -> None:
    assert token_buckets(2048) == TOKEN_LADDER == (1, 8, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 4096)
    assert token_buckets(512) == (1, 8, 32, 64, 96, 128, 192, 256, 384, 512)
    assert token_buckets(300) == (1, 8, 32, 64, 96, 128, 192, 256, 384)
    assert token_buckets(64) == (1, 8, 32, 64)
    assert token_buckets(16384) == (*TOKEN_LADDER, 16384)


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """(packaged dir, cache dir), both empty."""
    packaged, cache = tmp_path / "packaged", tmp_path / "cache"
    packaged.mkdir()
    monkeypatch.setattr(configs, "PACKAGED_DIR", packaged)
    monkeypatch.setattr(w8a16_plans, "PACKAGED_DIR", packaged)
    yield packaged, cache
    set_plan_cache_dir(None)


def tune_into(directory: Path, keys: list, buckets: list[int]) -> None:
    plans = {(key, bucket): Plan("split") for key in keys for bucket in buckets}
    update_plan_file(config_file("Test GPU", directory), "Test GPU", "test", plans)


def test_an_untuned_gpu_misses_every_bucket_in_ascending_order(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    shapes = adapted_layer(model_info(tmp_path, "llama"), 64)
    assert missing_buckets("Test GPU", shapes, 64, TOKEN_LADDER[::-1], tables[1]) == list(TOKEN_LADDER)


def test_buckets_in_the_packaged_table_or_the_cache_are_not_missing(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    packaged, cache = tables
    shapes = adapted_layer(model_info(tmp_path, "llama"), 64)
    keys = plan_keys(shapes, 64)
    tune_into(packaged, keys, [1, 8, 32])
    tune_into(cache, keys, [64, 4096])
    assert missing_buckets("Test GPU", shapes, 64, TOKEN_LADDER, cache) == [96, 128, 192, 256, 384, 512, 1024]


def test_a_partial_cache_file_resumes_where_the_last_tune_stopped(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    """A tune cut short wrote every bucket it finished, each for the whole layer."""
    shapes = adapted_layer(model_info(tmp_path, "llama"), 64)
    tune_into(tables[1], plan_keys(shapes, 64), [1, 8])
    assert missing_buckets("Test GPU", shapes, 64, TOKEN_LADDER, tables[1]) == list(TOKEN_LADDER[2:])


def test_a_bucket_one_projection_lacks_is_missing(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    shapes = adapted_layer(model_info(tmp_path, "llama"), 64)
    keys = plan_keys(shapes, 64)
    tune_into(tables[0], keys, list(TOKEN_LADDER))
    tune_into(tables[0], keys[:3], [8192])
    assert missing_buckets("Test GPU", shapes, 64, (*TOKEN_LADDER, 8192), tables[1]) == [8192]


def test_plans_of_another_rank_do_not_count(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    shapes = adapted_layer(model_info(tmp_path, "llama"), 16)
    tune_into(tables[0], plan_keys(shapes, 64), list(TOKEN_LADDER))
    assert missing_buckets("Test GPU", shapes, 16, TOKEN_LADDER, tables[1]) == list(TOKEN_LADDER)


def test_a_cpu_engine_tunes_nothing_but_searches_the_cache(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    assert ensure_tuned(model_info(tmp_path, "llama"), EngineConfig(device="cpu"), tables[1], 60.0) is None
    assert configs.plan_cache_dir() == tables[1]
    assert not tables[1].exists()


def test_an_engine_without_lora_tunes_nothing(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    # on this CPU-only machine, reaching the tuner would fail asking CUDA for the device's name
    no_lora = EngineConfig(device="cuda", max_loras=0)
    assert ensure_tuned(model_info(tmp_path, "llama"), no_lora, tables[1], 60.0) is None
    assert not tables[1].exists()


def test_a_worker_without_a_plan_cache_tunes_nothing_at_start(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    info = model_info(tmp_path, "llama")
    tune_at_start([info], EngineConfig(device="cpu"), None)
    assert configs.plan_cache_dir() is None
    tune_at_start([info], EngineConfig(device="cpu"), tables[1])
    assert configs.plan_cache_dir() == tables[1] and not tables[1].exists()


def test_a_tune_that_fails_is_logged_and_the_worker_starts_anyway(
    tmp_path: Path, tables: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("no candidate compiled")

    monkeypatch.setattr(kernel_plans, "ensure_tuned", broken)
    with capture_logs() as logs:
        tune_at_start([model_info(tmp_path, "llama")], EngineConfig(device="cpu"), tables[1])
    assert [e["event"] for e in logs] == ["kernel_tune_failed"]


def test_the_tune_budget_cannot_be_negative() -> None:
    with pytest.raises(ValueError, match="kernel_tune_budget_s"):
        EngineConfig(kernel_tune_budget_s=-1)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_w8a16_cells_are_the_weights_the_engines_layers_multiply(tmp_path: Path, family: str) -> None:
    info = model_info(tmp_path, family)
    model = CausalLM(info, max_loras=2, max_lora_rank=16, device="meta")
    # fp8_linear: x [T, in_features] against the weight [sum of the slices' out_features, in_features]
    weights = {
        (sum(linear.out_features), linear.in_features)
        for layer in model.model.layers
        for linear in layer.lora_linears()
    }
    cells = w8a16_cells(info)
    assert len(cells) == len(set(cells)) == len(weights) * len(W8A16_BUCKETS)
    assert {(n, k) for n, k, _ in cells} == weights
    assert [bucket for _, _, bucket in cells] == sorted(bucket for _, _, bucket in cells)  # decode sizes first


def test_w8a16_cells_in_either_table_are_not_missing(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    cache = tables[1]
    cells = w8a16_cells(model_info(tmp_path, "llama"))
    plan = W8A16Plan(16, 64, 128, 1, num_warps=4, num_stages=4)
    update_w8a16_file(w8a16_plans.config_file("Test GPU"), "Test GPU", "test", dict.fromkeys(cells[:4], plan))
    update_w8a16_file(w8a16_plans.config_file("Test GPU", cache), "Test GPU", "test", dict.fromkeys(cells[6:], plan))
    assert missing_w8a16_cells("Test GPU", cells, cache) == cells[4:6]
    assert missing_w8a16_cells("Other GPU", cells, cache) == cells


def test_only_a_model_served_in_fp8_on_a_gpu_tunes_w8a16_plans(tmp_path: Path, tables: tuple[Path, Path]) -> None:
    # on this CPU-only machine, reaching the tuner would fail asking CUDA for the device's name
    info = model_info(tmp_path, "llama")
    fp8 = info.served(quantization="fp8", kv_cache_dtype="auto", source=tmp_path / "llama")
    assert ensure_w8a16_tuned(info, EngineConfig(device="cuda"), tables[1], 60.0) is None
    assert ensure_w8a16_tuned(fp8, EngineConfig(device="cpu"), tables[1], 60.0) is None
    assert configs.plan_cache_dir() == tables[1] and not tables[1].exists()
