"""The memory plan of 4-bit serving (--quantization int4), counted on the meta device like any
model: the projections take a little over a quarter of their bf16 bytes, adapters stay as they are,
and the room saved goes to the KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.random_engine import LLAMA3_8B
from shared.config import EngineConfig
from tests.worker.test_memory_plan import GB, plan_one

CUDA = EngineConfig(device="cuda", max_num_seqs=512)


def served(quantization: str | None, *, int4_decode_copy: bool = False):
    return LLAMA3_8B.served(
        quantization=quantization, kv_cache_dtype="auto", source=Path("llama-3-8b"), int4_decode_copy=int4_decode_copy
    )


def test_int4_weights_take_a_quarter_of_the_projection_bytes():
    bf16 = plan_one(served(None), CUDA).footprints[LLAMA3_8B.name]
    int4 = plan_one(served("int4"), CUDA).footprints[LLAMA3_8B.name]
    # 6.98e9 projection weights at half a byte plus a float16 scale and zero per 128 (3.71 GB);
    # embedding and head (2 x 1.05 GB) stay bf16
    assert 5.8 * GB < int4.weights < 5.85 * GB < 9 * GB < bf16.weights
    assert int4.dense_lora == bf16.dense_lora  # adapters stay in the activations' dtype


def test_int4_weights_leave_the_kv_cache_more_room():
    assert plan_one(served("int4"), CUDA).kv_blocks(LLAMA3_8B.name) > plan_one(served(None), CUDA).kv_blocks(
        LLAMA3_8B.name
    )


def test_nf4_weights_take_their_codes_and_a_float32_absmax_per_block():
    nf4 = plan_one(served("nf4"), CUDA).footprints[LLAMA3_8B.name]
    int4 = plan_one(served("int4"), CUDA).footprints[LLAMA3_8B.name]
    # 6.98e9 projection weights at half a byte plus a float32 absmax per 64 (3.93 GB); embedding and
    # head (2 x 1.05 GB) stay bf16
    assert 6.0 * GB < nf4.weights < 6.05 * GB
    assert nf4.weights - int4.weights == pytest.approx(6.98e9 * (4 / 64 - 4 / 128), rel=0.01)
    assert nf4.dense_lora == int4.dense_lora  # the codebook is part of the weight, not of the adapters' memory


def test_the_tensor_core_copy_counts_half_a_byte_a_weight_and_a_bf16_scale_and_offset_per_group():
    copy = plan_one(served("int4", int4_decode_copy=True), CUDA)
    lean = plan_one(served("int4"), CUDA)
    added = copy.footprints[LLAMA3_8B.name].weights - lean.footprints[LLAMA3_8B.name].weights
    assert added == pytest.approx(6.98e9 * (1 / 2 + 4 / 128), rel=0.01)
    assert copy.kv_blocks(LLAMA3_8B.name) < lean.kv_blocks(LLAMA3_8B.name)  # the KV cache pays for it


def test_only_affine_weights_keep_the_copy():
    nf4 = served("nf4", int4_decode_copy=True)
    assert not nf4.int4_decode_copy
    assert (
        plan_one(nf4, CUDA).footprints[LLAMA3_8B.name].weights
        == plan_one(served("nf4"), CUDA).footprints[LLAMA3_8B.name].weights
    )
