"""The tensor cores' 4-bit layout (kernels/quant/int4_mma.py): the packing against its stated formula
and against torch's own packer (GPU), the conversion of an affine weight within its bf16 bound, and
the 4-bit linear with the copy: tinygemm on it up to TINYGEMM_MAX_TOKENS rows, the Triton kernel on
the k-major weight above, each against its torch reference (GPU), the reference off CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.quant import int4_linear
from kernels.quant.int4_mma import (
    INNER_K_TILES,
    MID_LEVEL,
    TINYGEMM_MAX_TOKENS,
    dequantize_mma,
    mma_layout_fits,
    pack_mma,
    tinygemm_linear,
    to_mma_layout,
    unpack_mma,
)
from kernels.quant.int4_reference import (
    MAX_LEVEL,
    Int4Weight,
    dequantize_int4,
    int4_linear_reference,
    linear_on_dequantized,
    quantize_int4,
    unpack_along_k,
)
from tests.kernels.lora_cases import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_levels(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, MAX_LEVEL + 1, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def random_int4(n: int, k: int, group: int, seed: int, device: str = DEVICE) -> Int4Weight:
    """N(0, 0.05) weights [n, k] quantized as at load, on `device`."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_int4(weight.to(device), group)[1]


def test_every_value_sits_where_the_layout_says():
    n, k = 16, 256
    q = random_levels(n, k, seed=0)
    q[0, :8] = MAX_LEVEL  # nibble 7 set somewhere: an int32 goes negative
    words = pack_mma(q)
    assert words.shape == (n // 8, k // 128, 32, 4) and words.dtype == torch.int32 and bool((words < 0).any())
    for column in range(n):
        for p in range(k // 8):
            word = int(words[column // 8, p // 16, 4 * (column % 8) + p % 4, (p // 4) % 4])
            for i in range(8):
                k_index = 32 * (p // 4) + 2 * (p % 4) + 8 * (i % 4) + i // 4
                assert (word >> (4 * i)) & MAX_LEVEL == q[column, k_index]
    assert torch.equal(unpack_mma(words), q)


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="MMA layout"):
        pack_mma(random_levels(12, 256, seed=1))
    with pytest.raises(ValueError, match="MMA layout"):
        pack_mma(random_levels(16, 96, seed=1))
    assert mma_layout_fits(4096, 14336, 128, torch.bfloat16)
    assert not mma_layout_fits(4096, 4096, 128, torch.float16)  # tinygemm multiplies bf16 only
    assert not mma_layout_fits(4096, 4096, 16, torch.bfloat16)
    assert not mma_layout_fits(4100, 4096, 128, torch.bfloat16)


@pytest.mark.parametrize("group", [32, 128])
def test_an_affine_weight_converts_within_the_bf16_rounding_of_scale_and_offset(group: int):
    weight = torch.randn(24, 512, generator=torch.Generator().manual_seed(group)) * 0.05
    levels, affine = quantize_int4(weight, group)
    mma = to_mma_layout(affine, columns=8)  # several column chunks
    assert torch.equal(unpack_mma(mma.qweight), unpack_along_k(affine.qweight).T)
    assert mma.shape == affine.shape and mma.group_size == group
    exact = dequantize_int4(affine)
    scales = affine.scales.float().repeat_interleave(group, dim=0).T  # [N, K]
    offsets = (MID_LEVEL - affine.zeros.float().repeat_interleave(group, dim=0).T) * scales
    # scale and offset each rounded to bf16 (a relative 2**-8 at most), float32's rounding beside it
    bound = 2.0**-8 * ((levels.T.float() - MID_LEVEL).abs() * scales + offsets.abs()) + 1e-7
    assert bool(((dequantize_mma(mma) - exact).abs() <= bound).all())


def test_only_affine_weights_convert():
    from kernels.quant.codebook import quantize_codebook

    codebook = quantize_codebook(torch.randn(16, 128), 64, "nf4")[1]
    with pytest.raises(ValueError, match="affine"):
        to_mma_layout(codebook)


def test_off_cuda_the_linear_takes_the_k_major_reference():
    affine = random_int4(16, 256, 64, seed=3, device="cpu")
    weight = dataclasses.replace(affine, tensor_cores=to_mma_layout(affine))
    x, bias = torch.randn(5, 256), torch.randn(16)
    assert torch.equal(int4_linear(x, weight, bias), int4_linear_reference(x, affine, bias))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="torch packs this layout on CUDA only")
def test_the_packing_is_torchs():
    q = random_levels(256, 512, seed=4).to(DEVICE)
    as_bytes = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # torch's input: even inputs in the high nibble
    assert torch.equal(pack_mma(q), torch._convert_weight_to_int4pack(as_bytes, INNER_K_TILES))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="tinygemm runs on CUDA only")
@pytest.mark.parametrize("m", [1, 2, TINYGEMM_MAX_TOKENS, TINYGEMM_MAX_TOKENS + 1, 64, 300])
@pytest.mark.parametrize("group", [32, 128])
def test_every_size_matches_the_reference_of_the_layout_it_reads(m: int, group: int):
    affine = random_int4(264, 1024, group, seed=m)
    weight = dataclasses.replace(affine, tensor_cores=to_mma_layout(affine))
    x = torch.randn(m, 1024, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(264, device=DEVICE, dtype=torch.bfloat16)
    if m <= TINYGEMM_MAX_TOKENS:
        expected = linear_on_dequantized(x, dequantize_mma(weight.tensor_cores), bias)
    else:
        expected = int4_linear_reference(x, affine, bias)
    # bf16 outputs of sums over 1,024 products: one bf16 rounding of y, and of the bias sum
    assert rel_err(int4_linear(x, weight, bias), expected) < 1e-2
    assert (
        rel_err(tinygemm_linear(x, weight.tensor_cores), linear_on_dequantized(x, dequantize_mma(weight.tensor_cores)))
        < 1e-2
    )
