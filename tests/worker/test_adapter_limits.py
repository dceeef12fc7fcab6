"""What a worker publishes that its adapter pool can serve: its --max-lora-rank, and the projections
the model has LoRA slots for, in the names adapter manifests use (both MoE adapter forms included)."""

from __future__ import annotations

import dataclasses

from bench.moe import QWEN3_30B_A3B
from bench.random_engine import LLAMA3_8B
from shared.config import EngineConfig
from shared.model_info import PROJECTIONS
from worker.adapter_pool.limits import adapter_limits

EXPERTS = ("experts.down_proj", "experts.gate_proj", "experts.gate_up_proj", "experts.up_proj")


def test_a_dense_model_serves_every_projection_up_to_the_max_rank():
    limits = adapter_limits(LLAMA3_8B, EngineConfig(max_lora_rank=16))
    assert limits.max_rank == 16 and limits.target_modules == PROJECTIONS


def test_an_moe_model_serves_attention_and_every_experts_projections_in_both_forms():
    limits = adapter_limits(QWEN3_30B_A3B, EngineConfig())
    assert limits.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", *EXPERTS)


def test_an_moe_model_with_a_dense_layer_also_serves_that_layers_mlp():
    first_dense = dataclasses.replace(QWEN3_30B_A3B, num_layers=3, moe_layers=(1, 2))
    assert adapter_limits(first_dense, EngineConfig()).target_modules == (*PROJECTIONS, *EXPERTS)


def test_a_worker_without_lora_serves_no_adapter():
    limits = adapter_limits(LLAMA3_8B, EngineConfig(max_loras=0))
    assert limits.max_rank == 0 and limits.target_modules == ()
    assert "runs without LoRA (--max-loras 0)" in limits.refusal(rank=1, target_modules=("q_proj",))
