"""What a tensor-parallel rank holds, computed on the CPU from shapes: the rank's share of heads and
widths, which KV head a rank holds when there are fewer than ranks, and the memory plan's per-rank
bytes (a 70B-shaped model fits two 141 GB GPUs, not one)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.random_engine import LLAMA3_8B
from shared.config import EngineConfig
from worker.memory_plan import DeviceMemory, MemoryPlanError, model_footprint, plan_memory
from worker.model.parallel.group import TensorParallel
from worker.model.parallel.sharding import ModelShard, shard_info

GB = 10**9
LLAMA_70B = dataclasses.replace(
    LLAMA3_8B, name="llama-70b-shape", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
    intermediate_size=28672,
)  # fmt: skip
H200 = DeviceMemory(total=141 * GB, free=140 * GB)


def shard(info, rank: int, size: int) -> ModelShard:
    return ModelShard.of(info, TensorParallel(rank, size))


def test_a_rank_builds_its_share_of_heads_and_widths():
    local = shard_info(LLAMA3_8B, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (16, 4, 7168)
    assert (local.hidden_size, local.vocab_size) == (LLAMA3_8B.hidden_size, LLAMA3_8B.vocab_size)


def test_a_model_that_does_not_split_evenly_is_refused_naming_what_does_not():
    with pytest.raises(ValueError, match="num_attention_heads, num_key_value_heads"):
        shard_info(dataclasses.replace(LLAMA3_8B, num_heads=30, num_kv_heads=6), 4)


def test_with_fewer_kv_heads_than_ranks_each_rank_holds_the_kv_head_its_query_heads_read():
    # 64 query heads, 8 KV heads (8 queries each), 16 ranks: 4 queries per rank, two ranks per KV head
    ranks = [shard(LLAMA_70B, rank, 16) for rank in range(16)]
    assert [r.local.num_kv_heads for r in ranks] == [1] * 16
    assert [r.kv_head_start for r in ranks] == [rank // 2 for rank in range(16)]
    head_dim = LLAMA_70B.head_dim
    assert ranks[5].split("k_proj").start == 2 * head_dim
    assert ranks[5].split("q_proj").start == 5 * 4 * head_dim


def test_column_and_row_parallel_splits_address_output_rows_and_input_columns():
    rank1 = shard(LLAMA3_8B, 1, 2)
    gate, down = rank1.split("gate_proj"), rank1.split("down_proj")
    assert (gate.dim, gate.start, gate.length) == (-2, 7168, 7168)
    assert (down.dim, down.start, down.length) == (-1, 7168, 7168)
    assert rank1.linear("q_proj", "k_proj", "v_proj").row_parallel is False
    assert rank1.linear("o_proj").row_parallel is True


def test_the_memory_plan_counts_one_ranks_bytes():
    one, two = (model_footprint(LLAMA3_8B, EngineConfig(device="cuda", tensor_parallel=size)) for size in (1, 2))
    assert 0.49 < two.weights / one.weights < 0.51  # everything is split but the norms
    assert two.kv_bytes_per_block * 2 == one.kv_bytes_per_block
    assert two.dense_lora < one.dense_lora  # A of column-parallel projections is whole on every rank


def test_a_70b_shaped_model_fits_two_141_gb_gpus_in_bf16_and_not_one():
    config = EngineConfig(device="cuda", dtype="bfloat16", max_loras=8, max_lora_rank=16, max_num_seqs=64)
    with pytest.raises(MemoryPlanError):
        plan_memory({LLAMA_70B.name: LLAMA_70B}, config, memory=H200)
    parallel = dataclasses.replace(config, tensor_parallel=2)
    plan = plan_memory({LLAMA_70B.name: LLAMA_70B}, parallel, memory=H200)
    footprint = plan.footprints[LLAMA_70B.name]
    assert 70 * GB < footprint.weights < 71 * GB  # half of 141 GB of bf16 weights
    assert plan.kv_blocks(LLAMA_70B.name) * footprint.kv_bytes_per_block > 40 * GB
