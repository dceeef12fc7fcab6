"""bench.lora_kernels' model layers: the benchmarks and bench.tune_lora time the layers a worker tunes
for the same models (worker.kernel_plans.adapted_layer), so their plans serve the engine."""

from __future__ import annotations

import dataclasses

import pytest

from bench.lora_kernels import MODELS
from bench.moe import QWEN3_30B_A3B
from bench.random_engine import LLAMA3_8B
from kernels.lora.tuning.timing import attention_heads
from shared.model_info import ModelInfo
from worker.kernel_plans import adapted_layer


@pytest.mark.parametrize(("name", "info"), [("llama-3-8b", LLAMA3_8B), ("qwen3-30b-a3b", QWEN3_30B_A3B)])
@pytest.mark.parametrize("rank", [16, 64])
def test_a_models_layer_is_the_one_a_worker_tunes(name: str, info: ModelInfo, rank: int) -> None:
    model, tuned = MODELS[name], adapted_layer(info, rank)
    # the bench keeps one page size per model; an unpaged pool (0) is one page of the whole rank
    assert dataclasses.replace(model, page_rank=model.page_rank or rank) == tuned
    assert attention_heads(model.projections[0].widths, model.head_dim) == (info.num_heads, info.num_kv_heads)


def test_qkv_widths_must_be_whole_heads_with_k_as_wide_as_v() -> None:
    with pytest.raises(ValueError, match="qkv widths"):
        attention_heads((4096, 1024, 512))
    with pytest.raises(ValueError, match="qkv widths"):
        attention_heads((4096, 1000, 1000))
    with pytest.raises(ValueError, match="64-wide heads"):
        attention_heads((4096, 1000, 1000), head_dim=64)
