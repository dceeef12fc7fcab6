"""The fused decoder-layer kernels (kernels/fused) against their torch references on random inputs,
in fp32/fp16 (on CPU through the interpreter; bf16 on the GPU only)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused import add_rms_norm, rms_norm, rope_and_cache_kv, silu_and_mul
from kernels.fused.activation import silu_and_mul_triton
from kernels.fused.norm import rms_norm_triton
from kernels.fused.reference import (
    add_rms_norm_reference,
    rms_norm_reference,
    rope_and_cache_kv_reference,
    silu_and_mul_reference,
)
from kernels.fused.rope import rope_and_cache_kv_triton
from tests.kernels.lora_cases import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 64), (7, 96), (5, 4096), (3, 576)])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, num_tokens: int, hidden: int):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden)
    weight = randn(hidden, dtype=dtype, seed=hidden + 1)
    out = rms_norm_triton(x, weight, 1e-5)
    assert rel_err(out, rms_norm_reference(x, weight, 1e-5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(3, 80), (9, 4096), (4, 576)])
def test_add_rms_norm_writes_the_sum_into_the_residual(dtype: torch.dtype, num_tokens: int, hidden: int):
    # x is a row-strided view, as the rows gathered from a wider buffer are
    x = randn(num_tokens, hidden + 16, dtype=dtype, seed=num_tokens)[:, :hidden]
    residual = randn(num_tokens, hidden, dtype=dtype, seed=num_tokens + 1)
    weight = randn(hidden, dtype=dtype, seed=num_tokens + 2)
    ref_out, ref_sum = add_rms_norm_reference(x, residual.clone(), weight, 1e-6)
    out = rms_norm_triton(x, weight, 1e-6, residual)
    assert torch.equal(residual, ref_sum)  # one rounding of the same fp32 sum
    assert rel_err(out, ref_out) < TOLERANCE[dtype]


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "width"), [(1, 24), (6, 1000), (3, 2304), (4, 1536)])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, num_tokens: int, width: int, with_delta: bool):
    gate_up = randn(num_tokens, 2 * width, dtype=dtype, seed=width) * 3
    # a LoRA delta beside the projection: a strided view, as a wider buffer's columns would be
    delta = randn(num_tokens, 2 * width + 8, dtype=dtype, seed=width + 1)[:, : 2 * width] if with_delta else None
    out = silu_and_mul_triton(gate_up, delta)
    assert rel_err(out, silu_and_mul_reference(gate_up, delta)) < TOLERANCE[dtype]
    if with_delta:  # the delta moved the result: it was read, not ignored
        assert rel_err(out, silu_and_mul_reference(gate_up)) > 0.1


def rope_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """qkv, cos/sin of random positions, poisoned caches of 6 blocks × 4 and distinct random slots."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 5000, (num_tokens,), generator=generator).float()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = (t.to(dtype=dtype, device=DEVICE) for t in (angles.cos(), angles.sin()))
    cache = torch.full((6, 4, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(24, generator=generator)[:num_tokens].to(DEVICE)
    return qkv, cos, sin, cache, cache.clone(), slots


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 48), (2, 2, 128), (9, 3, 64)])
def test_rope_and_cache_kv_matches_the_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, with_delta: bool
):
    qkv, cos, sin, key_cache, value_cache, slots = rope_case(5, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    delta = randn(*qkv.shape, dtype=dtype, seed=head_dim + 1) if with_delta else None
    ref_qkv, ref_keys, ref_values = qkv.clone(), key_cache.clone(), value_cache.clone()
    ref_q = rope_and_cache_kv_reference(ref_qkv, cos, sin, ref_keys, ref_values, slots, num_heads, delta)
    untouched = qkv.clone()
    q = rope_and_cache_kv_triton(qkv, cos, sin, key_cache, value_cache, slots, num_heads, delta)
    assert q.data_ptr() == qkv.data_ptr()  # q rotated in place
    assert rel_err(q, ref_q) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, q[0].numel() :], untouched[:, q[0].numel() :])  # k and v left as they were
    written = torch.zeros(24, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    for cache, ref in ((key_cache, ref_keys), (value_cache, ref_values)):
        flat, ref_flat = cache.view(24, -1), ref.view(24, -1)
        assert flat[~written].isnan().all()  # nothing outside the step's slots
        assert rel_err(flat[written], ref_flat[written]) < TOLERANCE[dtype]


def test_the_dispatchers_take_the_references_on_cpu_tensors():
    x = torch.randn(3, 32)
    residual = torch.randn(3, 32)
    weight = torch.randn(32)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    out, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, rms_norm_reference(x + residual, weight, 1e-5))
    gate_up = torch.randn(3, 64)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
    qkv = torch.randn(2, 4 * 16)
    cos, sin = torch.randn(2, 16), torch.randn(2, 16)
    caches = [torch.zeros(2, 2, 1, 16) for _ in range(4)]
    slots = torch.tensor([3, 0])
    q = rope_and_cache_kv(qkv.clone(), cos, sin, caches[0], caches[1], slots, 2)
    ref = rope_and_cache_kv_reference(qkv.clone(), cos, sin, caches[2], caches[3], slots, 2)
    assert torch.equal(q, ref) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
