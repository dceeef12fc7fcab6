"""The FP8 KV cache (--kv-cache-dtype fp8): RoPE + KV write into fp8 caches with per-head K and V
scales and paged attention over them, each Triton kernel against its torch reference (fp32/fp16
through the interpreter, bf16 on the GPU), and the reference against attention over the same K/V
rounded to fp8 and scaled back."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention_reference, paged_attention_triton, store_kv
from kernels.fused.reference import rope_and_cache_kv_reference
from kernels.fused.rope import rope_and_cache_kv_triton
from kernels.quant import FP8_DTYPE
from kernels.quant.reference import FP8_MAX, to_fp8_saturated
from tests.kernels.attention_cases import make_case
from tests.kernels.lora_cases import rel_err
from tests.kernels.test_fused import rope_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
E4M3_STEP = 2**-3  # relative spacing of e4m3's normal values: a rounding moves a value by at most half


def head_scales(num_kv_heads: int, seed: int) -> torch.Tensor:
    """float32 [2, num_kv_heads]: K's and V's scales, each head's different, spanning 2**-10 … 2**2."""
    generator = torch.Generator().manual_seed(seed)
    return (2.0 ** (torch.rand(2, num_kv_heads, generator=generator) * 12 - 10)).to(DEVICE)


def fp8_caches(num_kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    return [torch.zeros(6, 4, num_kv_heads, head_dim, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 48)])
def test_rope_writes_scaled_fp8_caches_as_the_reference_does(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
):
    qkv, cos, sin, _, _, slots = rope_case(5, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    scales = head_scales(num_kv_heads, seed=head_dim)
    qkv[0, -head_dim:] *= 1000 * scales[1, -1].item()  # a v head past fp8's ±448 once scaled: saturates
    caches = fp8_caches(num_kv_heads, head_dim)
    ref_q = rope_and_cache_kv_reference(qkv.clone(), cos, sin, caches[0], caches[1], slots, num_heads, None, scales)
    q = rope_and_cache_kv_triton(qkv, cos, sin, caches[2], caches[3], slots, num_heads, None, scales)
    assert rel_err(q, ref_q) < TOLERANCE[dtype]
    # each cached value is the reference's rotated k / v in the activation dtype over its head's scale,
    # rounded to fp8: bit for bit where the two rotations agree, and they agree to the dtype's rounding
    for ours, ref in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert not ours.float().isnan().any()
        assert rel_err(ours.float(), ref.float()) < 2 * E4M3_STEP / 2
    assert caches[3].float().abs().max() == FP8_MAX  # the enlarged v head, saturated


def test_the_value_cache_is_bit_exact_in_fp8():
    # v is copied, not rotated: nothing between the two paths but the fp32 division and the rounding
    qkv, cos, sin, _, _, slots = rope_case(7, 2, 2, 64, torch.float32, seed=3)
    scales = head_scales(2, seed=3)
    caches = fp8_caches(2, 64)
    rope_and_cache_kv_reference(qkv.clone(), cos, sin, caches[0], caches[1], slots, 2, None, scales)
    rope_and_cache_kv_triton(qkv, cos, sin, caches[2], caches[3], slots, 2, None, scales)
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


def test_a_head_scale_keeps_small_values_out_of_e4m3s_subnormals():
    # values around 1e-3 (e4m3's subnormals span 2**-9 … 2**-6 ≈ 2e-3 … 1.6e-2): unscaled, most become
    # 0 or one subnormal step; over a scale mapping each head's amax to 448, each keeps 3 mantissa bits
    values = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 1e-3
    amax = values.abs().amax(dim=(0, 2))  # [2]: per head
    slots = torch.arange(64, device=DEVICE)
    errors = []
    for scales in (torch.ones(2, 2, device=DEVICE), torch.stack([amax, amax]) / FP8_MAX):
        key_cache, value_cache = (torch.zeros(16, 4, 2, 32, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2))
        store_kv(values, values, key_cache, value_cache, slots, scales)
        errors.append(rel_err(key_cache.view(-1, 2, 32).float() * scales[0, :, None], values))
    unscaled, scaled = errors
    assert unscaled > 0.3  # the subnormals lose a large share of each value
    assert scaled <= E4M3_STEP / 2  # every value (but the few near 0, of little norm) rounds to 3 bits


def fp8_case(kind: list[tuple[int, int]], dtype: torch.dtype, seed: int):
    """An attention case whose caches hold its random K/V over per-head scales, in fp8; `.scales`."""
    case = make_case(
        kind, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype, device=DEVICE, seed=seed
    )
    case.scales = head_scales(2, seed)
    case.key_cache = to_fp8_saturated(case.key_cache.float() / case.scales[0, :, None])
    case.value_cache = to_fp8_saturated(case.value_cache.float() / case.scales[1, :, None])
    return case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[(1, 9), (1, 17), (1, 3)], [(5, 12), (1, 7), (8, 8)]], ids=["decode", "mixed"])
def test_paged_attention_reads_scaled_fp8_caches_as_the_reference_does(dtype: torch.dtype, lens: list[tuple[int, int]]):
    case = fp8_case(lens, dtype, seed=len(lens))
    out = paged_attention_triton(*case.args(), None, case.scales)
    assert out.dtype == dtype
    assert rel_err(out, paged_attention_reference(*case.args(), None, case.scales)) < TOLERANCE[dtype]


def test_fp8_attention_is_attention_over_the_dequantized_cache():
    case = fp8_case([(3, 10), (1, 6)], torch.float32, seed=7)
    dequantized = list(case.args())
    dequantized[1] = case.key_cache.float() * case.scales[0, :, None]
    dequantized[2] = case.value_cache.float() * case.scales[1, :, None]
    ours = paged_attention_reference(*case.args(), None, case.scales)
    assert rel_err(ours, paged_attention_reference(*dequantized)) < 1e-6  # fp32: where each scale goes


@pytest.mark.parametrize("attend", [paged_attention_reference, paged_attention_triton])
def test_an_fp8_cache_without_scales_is_refused(attend):
    case = fp8_case([(1, 5)], torch.float32, seed=1)
    with pytest.raises(ValueError, match="kv_scales"):
        attend(*case.args())
    with pytest.raises(ValueError, match="kv_scales"):
        attend(*case.args(), None, case.scales[:, :1])
