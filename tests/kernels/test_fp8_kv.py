"""The FP8 KV cache (--kv-cache-dtype fp8): RoPE + KV write into fp8 caches and paged attention over
them, each Triton kernel against its torch reference (fp32/fp16 through the interpreter, bf16 on the
GPU), and the reference against attention over the same K/V rounded to fp8 and back."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention_reference, paged_attention_triton
from kernels.fused.reference import rope_and_cache_kv_reference
from kernels.fused.rope import rope_and_cache_kv_triton
from kernels.quant import FP8_DTYPE
from kernels.quant.reference import to_fp8_saturated
from tests.kernels.attention_cases import make_case
from tests.kernels.lora_cases import rel_err
from tests.kernels.test_fused import rope_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 48)])
def test_rope_writes_fp8_caches_as_the_reference_does(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
):
    qkv, cos, sin, _, _, slots = rope_case(5, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    qkv[0, -head_dim:] *= 1000  # a v head past fp8's ±448: saturates instead of becoming NaN
    caches = [torch.zeros(6, 4, num_kv_heads, head_dim, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    ref_q = rope_and_cache_kv_reference(qkv.clone(), cos, sin, caches[0], caches[1], slots, num_heads)
    q = rope_and_cache_kv_triton(qkv, cos, sin, caches[2], caches[3], slots, num_heads)
    assert rel_err(q, ref_q) < TOLERANCE[dtype]
    # each cached value is the reference's rotated k / v in the activation dtype, rounded to fp8:
    # bit for bit where the two rotations agree, and they agree to the activation dtype's rounding
    for ours, ref in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert not ours.float().isnan().any()
        assert rel_err(ours.float(), ref.float()) < 2 * 2**-4
    assert caches[3].float().abs().max() == 448  # the scaled v head, saturated


def test_the_value_cache_is_bit_exact_in_fp8():
    # v is copied, not rotated: nothing between the two paths but the fp8 rounding itself
    qkv, cos, sin, _, _, slots = rope_case(7, 2, 2, 64, torch.float32, seed=3)
    caches = [torch.zeros(6, 4, 2, 64, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    rope_and_cache_kv_reference(qkv.clone(), cos, sin, caches[0], caches[1], slots, 2)
    rope_and_cache_kv_triton(qkv, cos, sin, caches[2], caches[3], slots, 2)
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


def fp8_case(kind: list[tuple[int, int]], dtype: torch.dtype, seed: int):
    case = make_case(
        kind, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype, device=DEVICE, seed=seed
    )
    case.key_cache, case.value_cache = to_fp8_saturated(case.key_cache), to_fp8_saturated(case.value_cache)
    return case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[(1, 9), (1, 17), (1, 3)], [(5, 12), (1, 7), (8, 8)]], ids=["decode", "mixed"])
def test_paged_attention_reads_fp8_caches_as_the_reference_does(dtype: torch.dtype, lens: list[tuple[int, int]]):
    case = fp8_case(lens, dtype, seed=len(lens))
    out = paged_attention_triton(*case.args())
    assert out.dtype == dtype
    assert rel_err(out, paged_attention_reference(*case.args())) < TOLERANCE[dtype]


def test_fp8_attention_is_attention_over_the_widened_cache():
    case = fp8_case([(3, 10), (1, 6)], torch.float32, seed=7)
    widened = list(case.args())
    widened[1], widened[2] = case.key_cache.float(), case.value_cache.float()
    assert torch.equal(paged_attention_reference(*case.args()), paged_attention_reference(*widened))
