"""bench.lora_kernels' model layers: the tuner keys plans by the projection shapes the engine looks up."""

from __future__ import annotations

import pytest

from bench.engine import LLAMA3_8B
from bench.lora_kernels import MODELS
from bench.moe import QWEN3_30B_A3B
from kernels.lora.tuning import ProjectionShape
from kernels.lora.tuning.timing import attention_heads
from shared.model_info import ModelInfo
from worker.engine.lora_linear import PAGE_RANK


def engine_shapes(info: ModelInfo) -> tuple[ProjectionShape, ...]:
    """(name, K, slice widths) of each dense LoRALinear of one decoder layer of the engine's model."""
    qkv = tuple(info.projection_shape(p)[1] for p in ("q_proj", "k_proj", "v_proj"))
    o_k, o_n = info.projection_shape("o_proj")
    attention = (("qkv", info.hidden_size, qkv), ("o", o_k, (o_n,)))
    if info.is_moe:
        return attention
    down_k, down_n = info.projection_shape("down_proj")
    gate_up = ("gate_up", info.hidden_size, (info.intermediate_size,) * 2)
    return (*attention, gate_up, ("down", down_k, (down_n,)))


@pytest.mark.parametrize(("name", "info"), [("llama-3-8b", LLAMA3_8B), ("qwen3-30b-a3b", QWEN3_30B_A3B)])
def test_a_models_layer_is_the_engines(name: str, info: ModelInfo) -> None:
    model = MODELS[name]
    assert model.projections == engine_shapes(info)
    assert info.head_dim == model.head_dim
    assert attention_heads(model.projections[0].widths) == (info.num_heads, info.num_kv_heads)
    assert model.qk_norm == info.qk_norm
    # worker.engine.model: an MoE model's adapters take one page of their whole max rank
    assert model.page_rank == (0 if info.is_moe else PAGE_RANK)


def test_qkv_widths_must_be_whole_heads_with_k_as_wide_as_v() -> None:
    with pytest.raises(ValueError, match="qkv widths"):
        attention_heads((4096, 1024, 512))
    with pytest.raises(ValueError, match="qkv widths"):
        attention_heads((4096, 1000, 1000))
