"""The memory plan of FP8 serving (--quantization fp8, --kv-cache-dtype fp8), counted on the meta
device like any model: fp8 projections take half their bf16 bytes, and an fp8 KV cache about twice
the blocks in the same room."""

from __future__ import annotations

from pathlib import Path

from bench.engine import LLAMA3_8B
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
