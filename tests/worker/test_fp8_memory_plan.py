"""The memory plan of FP8 serving (--quantization fp8, --kv-cache-dtype fp8), counted on the meta
device like any model: fp8 projections (dense and MoE experts) take half their bf16 bytes, and an
fp8 KV cache about twice the blocks in the same room."""

from __future__ import annotations

from pathlib import Path

from bench.moe import QWEN3_30B_A3B
from bench.random_engine import LLAMA3_8B
from shared.config import EngineConfig
from tests.worker.test_memory_plan import GB, plan_one

# enough sequences that a full batch of full contexts outgrows the room: the blocks are not capped
CUDA = EngineConfig(device="cuda", max_num_seqs=512)


def served(quantization: str | None, kv_cache_dtype: str):
    return LLAMA3_8B.served(quantization=quantization, kv_cache_dtype=kv_cache_dtype, source=Path("llama-3-8b"))


def test_fp8_weights_take_about_half_the_bytes():
    bf16 = plan_one(served(None, "auto"), CUDA).footprints[LLAMA3_8B.name]
    fp8 = plan_one(served("fp8", "auto"), CUDA).footprints[LLAMA3_8B.name]
    # the 7B parameters of the projections halve; embedding and head (2 x 0.5B) stay bf16
    assert 9.0 * GB < fp8.weights < 9.2 * GB < bf16.weights
    assert fp8.dense_lora == bf16.dense_lora  # adapters stay in the activations' dtype


def test_an_fp8_kv_cache_holds_about_twice_the_blocks():
    bf16 = plan_one(served(None, "auto"), CUDA)
    fp8 = plan_one(served(None, "fp8"), CUDA)
    assert fp8.footprints[LLAMA3_8B.name].kv_bytes_per_block * 2 == bf16.footprints[LLAMA3_8B.name].kv_bytes_per_block
    assert fp8.kv_blocks(LLAMA3_8B.name) >= 1.9 * bf16.kv_blocks(LLAMA3_8B.name)


def test_fp8_weights_and_kv_together_leave_the_kv_cache_more_room():
    both = plan_one(served("fp8", "fp8"), CUDA)
    bf16 = plan_one(served(None, "auto"), CUDA)
    assert both.kv_blocks(LLAMA3_8B.name) > 2 * bf16.kv_blocks(LLAMA3_8B.name)


def test_fp8_moe_experts_take_one_byte_a_weight_and_a_float32_scale_a_row():
    """Qwen3-30B-A3B with --quantization fp8: every expert projection (and attention's) at one byte
    per weight plus a float32 scale per output row; expert LoRA slots stay bf16."""
    info, config = QWEN3_30B_A3B, EngineConfig(device="cuda", max_loras=2, max_lora_rank=16)
    source = Path("qwen3-30b-a3b")
    bf16 = plan_one(info, config)
    fp8 = plan_one(info.served(quantization="fp8", kv_cache_dtype="auto", source=source), config)
    layers, experts, hidden, width = info.num_layers, info.num_experts, info.hidden_size, info.moe_intermediate_size
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    weights = layers * (experts * 3 * hidden * width + hidden * (q + 2 * kv) + q * hidden)
    scale_rows = layers * (experts * (2 * width + hidden) + (q + 2 * kv) + hidden)
    saved = bf16.footprints[info.name].weights - fp8.footprints[info.name].weights
    assert saved == 2 * weights - (weights + 4 * scale_rows)  # bf16 bytes less fp8 bytes and scales
    assert 31 * GB < fp8.footprints[info.name].weights < 31.5 * GB  # of bf16's 61 GB
    assert fp8.footprints[info.name].expert_lora == bf16.footprints[info.name].expert_lora
    assert fp8.kv_blocks(info.name) > bf16.kv_blocks(info.name)
