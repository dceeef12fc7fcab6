"""Codebook 4-bit weights (NF4, FP4: kernels/quant/codebook.py): the quantizer onto bitsandbytes'
tables, and the W4A16 kernels' codebook dequantization against the torch reference (fp32/fp16
through the interpreter, bf16 on the GPU), one-row and tensor-core kernels, split-K included. On the
GPU the named tables are looked up in registers (codebook_lookup.py): bit for bit the levels the
table in memory gives, per tile and per GEMM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from kernels.quant.codebook import NF4_CODES, codebook, quantize_codebook
from kernels.quant.int4_gemm import Int4Config, _dequantize_tile, dequantization, int4_config, int4_gemm
from kernels.quant.int4_reference import (
    Int4Weight,
    arrival_counters,
    dequantize_int4,
    int4_linear_reference,
    pack_along_k,
)
from tests.kernels.test_int4 import DEVICE, DTYPES, random_levels


def random_codebook_weight(n: int, k: int, block: int, quant_type: str, seed: int) -> Int4Weight:
    """A codebook weight [n, k] with random codes and float32 absmax per block."""
    generator = torch.Generator().manual_seed(seed)
    return Int4Weight(
        qweight=pack_along_k(random_levels(k, n, seed)).to(DEVICE),
        scales=(torch.rand(k // block, n, generator=generator) * 0.1 + 1e-3).to(DEVICE),
        zeros=None,
        arrivals=arrival_counters(DEVICE),
        codebook=codebook(quant_type, DEVICE),
        codebook_name=quant_type,
    )


def test_the_tables_are_bitsandbytes_levels():
    nf4 = codebook("nf4")
    assert nf4.tolist() == list(NF4_CODES) and torch.equal(nf4, nf4.sort().values)
    fp4 = codebook("fp4")  # code order: sign bit 8, 0b011 the largest magnitude, 0b001 the subnormal
    assert fp4[3] == 1.0 and fp4[11] == -1.0 and fp4[2] == pytest.approx(2 / 3) and fp4[1] == pytest.approx(1 / 192)
    with pytest.raises(ValueError, match="'int8'"):
        codebook("int8")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_quantizer_picks_the_nearest_level_of_each_block(quant_type: str):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 256, generator=generator) * torch.logspace(-3, 1, 24)[:, None]
    weight[4] = 0.0  # an all-zero row quantizes to the zero code, with absmax 0
    codes = codebook(quant_type)
    levels, packed = quantize_codebook(weight, 64, quant_type)
    absmax = weight.abs().reshape(24, 4, 64).amax(-1)
    assert torch.equal(packed.scales, absmax.T) and packed.scales.dtype == torch.float32 and packed.group_size == 64
    assert packed.zeros is None and torch.equal(packed.codebook, codes) and packed.codebook_name == quant_type
    scaled = (weight.reshape(24, 4, 64) / absmax.clamp(min=1e-38)[..., None]).reshape(24, 256)
    nearest = (scaled[..., None] - codes).abs().amin(-1)
    chosen = (scaled - codes[levels.T.long()]).abs()
    assert torch.allclose(chosen, nearest, atol=1e-6)  # no level is nearer than the chosen one
    dequantized = dequantize_int4(packed)
    assert torch.equal(dequantized, codes[levels.T.long()] * absmax.repeat_interleave(64, 1))
    assert bool((dequantized[4] == 0).all())
    assert dequantized.abs().amax() == weight.abs().amax()  # each block's largest magnitude is exact


def test_a_weight_needs_zero_points_or_a_codebook_not_both():
    weight = random_codebook_weight(16, 64, 64, "nf4", seed=0)
    with pytest.raises(ValueError, match="exactly one"):
        dataclasses.replace(weight, zeros=weight.scales.half())
    with pytest.raises(ValueError, match="exactly one"):
        dataclasses.replace(weight, codebook=None)
    with pytest.raises(ValueError, match="'int8'"):
        dataclasses.replace(weight, codebook_name="int8")


CASES = [  # (M, N, K, block): one row, decode sizes, prefill tiles; blocks of 64 (bitsandbytes') and more
    (1, 72, 256, 64),
    (5, 40, 256, 64),
    (17, 136, 512, 256),
    (70, 96, 256, 64),
]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "block"), CASES)
def test_codebook_gemm_matches_the_reference(quant_type: str, dtype: torch.dtype, m: int, n: int, k: int, block: int):
    weight = random_codebook_weight(n, k, block, quant_type, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype=dtype, device=DEVICE)
    config = int4_config(m, n, k, block, sm_count=132)
    if DEVICE == "cpu" and m <= 16:  # the interpreter runs every program in Python: small tiles keep it quick
        config = dataclasses.replace(config, block_n=32, block_k=32, split_k=1)
    y = int4_gemm(x, weight, config)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # float32 sums in a different order; one 16-bit rounding
    assert torch.allclose(y.float(), int4_linear_reference(x, weight).float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("m", "config"), [(1, Int4Config(1, 32, 32, 3, 4, 1, gemv=True)), (20, Int4Config(16, 32, 32, 2, 4, 1))]
)
def test_split_k_codebook_launches_sum_the_reference_product(m: int, config: Int4Config):
    weight = random_codebook_weight(40, 384, 64, "nf4", seed=4)
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    first = int4_gemm(x, weight, config)
    assert torch.allclose(first, int4_linear_reference(x, weight), rtol=1e-4, atol=1e-4)
    assert torch.equal(int4_gemm(x, weight, config), first)  # the counters are back at zero


def test_a_codebook_weight_with_float16_scales_is_refused():
    weight = random_codebook_weight(32, 64, 64, "nf4", seed=1)
    with pytest.raises(ValueError, match="float32 scales"):
        int4_gemm(torch.randn(2, 64, device=DEVICE), dataclasses.replace(weight, scales=weight.scales.half()))


def every_code_weight(n: int, k: int, block: int, quant_type: str) -> Int4Weight:
    """A codebook weight [n, k] in which every code sits at every nibble position of some int32."""
    codes = (torch.arange(k)[:, None] + torch.arange(n)[None, :] * 3) % 16  # [K, N]
    return dataclasses.replace(
        random_codebook_weight(n, k, block, quant_type, seed=n), qweight=pack_along_k(codes).to(DEVICE)
    )


@triton.jit
def _tile_kernel(out_ptr, qweight_ptr, scales_ptr, codebook_ptr, N, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr):  # fmt: skip
    """out float32 [K / 8, 8, N]: every K tile of the weight as _dequantize_tile gives it."""
    tile = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w = _dequantize_tile(qweight_ptr, scales_ptr, scales_ptr, codebook_ptr, tile, offs_n, mask_n, N, GROUP, BLOCK_K,
                         DEQUANT)  # fmt: skip
    rows = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    offs = (rows[:, None, None] * 8 + tl.arange(0, 8)[None, :, None]) * N + offs_n[None, None, :]
    tl.store(out_ptr + offs, w, mask=mask_n[None, None, :])


def dequantized_tiles(weight: Int4Weight, dequant: str) -> torch.Tensor:
    """float32 [N, K]: the weight as the kernels' DEQUANT `dequant` dequantizes it, tile by tile."""
    n, k = weight.shape
    out = torch.empty(k // 8, 8, n, device=DEVICE)
    block_k, block_n = 64, 64
    grid = (k // block_k, triton.cdiv(n, block_n))
    _tile_kernel[grid](out, weight.qweight, weight.scales, weight.codebook, n, weight.group_size, block_k, block_n,
                       dequant)  # fmt: skip
    return out.reshape(k, n).T


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="inline PTX runs on the GPU only")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_registers_dequantize_every_code_as_the_table_in_memory(quant_type: str):
    weight = every_code_weight(200, 256, 64, quant_type)  # N 200: the last column tile masked
    in_registers = dequantized_tiles(weight, quant_type)
    assert torch.equal(in_registers, dequantized_tiles(weight, "table"))
    assert torch.equal(in_registers, dequantize_int4(weight))  # float32 level x float32 absmax, as torch rounds it


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="inline PTX runs on the GPU only")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("m", [1, 5, 70, 300])  # the CUDA-core kernel, decode tiles, 65-256 rows, prefill
@pytest.mark.parametrize("n", [4096, 200])  # split-K; a masked last column tile
def test_gemm_in_registers_matches_the_gemm_reading_the_table(quant_type: str, m: int, n: int):
    weight = every_code_weight(n, 1024, 64, quant_type)
    unnamed = dataclasses.replace(weight, codebook_name=None)  # any other table: read from memory
    assert (dequantization(weight), dequantization(unnamed)) == (quant_type, "table")
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(dtype=torch.bfloat16, device=DEVICE)
    y = int4_gemm(x, weight)
    # the weights are the table's bit for bit (the test above), but the two programs may contract the
    # scale multiply into the sum's FMAs differently (seen on an H100 at N 4096, M 1 and 5: split-K):
    # float32 sums that differ in their last bits: bf16 outputs one rounding step apart (rtol), or a
    # few float32 steps of the ~30-magnitude partial sums where they cancel to near zero (atol); a
    # wrong level would be off by ~0.1
    torch.testing.assert_close(y, int4_gemm(x, unnamed), rtol=2**-7, atol=1e-3)
    assert torch.allclose(y.float(), int4_linear_reference(x, weight).float(), rtol=1e-2, atol=1e-2)
