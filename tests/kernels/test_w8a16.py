"""The W8A16 decode GEMM (kernels/quant/w8a16.py) against its torch reference: fp16 and fp32 through
the interpreter (the interpreter's bf16 is not trusted, as in the other kernel tests), bf16 and the
Llama-8B projection shapes on the GPU; with and without the K split, bias, odd sizes.

Bound: the kernel and the reference add the same exact products (an fp8 value times a bf16/fp16
value is exact in fp32) in different orders, so they differ by the fp32 sum's reassociation, at most
K * 2**-24 of the sum of |products|, plus the output's rounding to x's dtype: half an ulp, 2**-8
(bf16), 2**-11 (fp16) or 2**-24 (fp32) of the value."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import W8A16_MAX_TOKENS, dequantize, fp8_linear, quantize_weight
from kernels.quant.reference import w8a8_linear_reference, weight_only_linear_reference
from kernels.quant.w8a16 import w8a16_linear
from kernels.quant.w8a16_plans import W8A16Plan, default_plan
from tests.kernels.lora_cases import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_ULP = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}


def operands(num_tokens: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    """(x [M, K], fp8 weight [N, K], float32 scales [N], bias [N]) with per-channel magnitudes that differ."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) * torch.logspace(-3, 0, n)[:, None]
    q, scales = quantize_weight(weight)
    bias = torch.randn(n, generator=generator)
    return x.to(device, dtype), q.to(device), scales.to(device), bias.to(device, dtype)


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias):
    """y [M, N] against the exact sum, within the module docstring's bound."""
    w = dequantize(q, scales)
    exact = x.double() @ w.double().T + (0.0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.double().abs().T
    bound = exact.abs() * HALF_ULP[x.dtype] + magnitude * x.shape[1] * 2**-24 + 2**-24
    assert y.dtype == x.dtype and y.shape == exact.shape
    excess = (y.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{excess.max().item()} past the bound"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("num_tokens", "n", "k"), [(1, 96, 200), (7, 70, 333), (16, 33, 64), (33, 130, 1000),
                                                    (64, 50, 129)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_matches_the_reference(dtype: torch.dtype, num_tokens: int, n: int, k: int, bias: bool):
    x, q, scales, b = operands(num_tokens, n, k, dtype, seed=num_tokens + n)
    b = b if bias else None
    y = w8a16_linear(x, q, scales, b)
    assert_within_rounding(y, x, q, scales, b)
    assert rel_err(y, weight_only_linear_reference(x, q, scales, b)) < 4 * HALF_ULP[dtype] + 1e-6


@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_split_partials_sum_to_the_same_result(split_k: int):
    # K = 700 in BLOCK_K 64 steps: 11 steps over 2, 3 or 5 ranges, the last one short
    x, q, scales, b = operands(5, 48, 700, torch.float16, seed=split_k)
    for block_m, swap in ((16, False), (16, True), (32, True)):  # both operand orders
        plan = W8A16Plan(block_m, 32, 64, split_k, num_warps=4, num_stages=2, swap=swap)
        y = w8a16_linear(x, q, scales, b, plan=plan)
        assert_within_rounding(y, x, q, scales, b)


def test_a_row_strided_x_is_read_in_place():
    x, q, scales, _ = operands(6, 40, 96, torch.float16, seed=3)
    wide = torch.zeros(6, 160, dtype=x.dtype, device=DEVICE)
    wide[:, :96] = x
    assert torch.equal(w8a16_linear(wide[:, :96], q, scales), w8a16_linear(x, q, scales))


def test_default_plans_fill_the_gpu_at_llama_8b_widths():
    # streaming (up to 16 tokens): qkv, o and down split K for three programs per SM (at most 4 ways);
    # past 16 about one program per SM: only o and down (64 tiles of 64 channels) split, in two
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for num_tokens in (1, 8, 16):
            plan = default_plan(num_tokens, n, k, num_sms=132)
            assert -(-n // plan.block_n) * plan.split_k >= 3 * 132 or plan.split_k == 4
            assert not plan.swap
        for num_tokens in (17, 32, 64):
            plan = default_plan(num_tokens, n, k, num_sms=132)
            assert plan.split_k == (2 if n == 4096 else 1) and plan.block_m >= num_tokens and plan.swap


def test_fp8_linear_switches_to_w8a8_past_decode_sizes():
    # the CPU path applies the same rule as CUDA: W8A16 up to W8A16_MAX_TOKENS tokens, W8A8 past it
    x, q, scales, b = operands(W8A16_MAX_TOKENS + 1, 24, 80, torch.float32, seed=9, device="cpu")
    assert torch.equal(fp8_linear(x, q, scales, b), w8a8_linear_reference(x, q, scales, b))
    decode = x[:W8A16_MAX_TOKENS]
    assert torch.equal(fp8_linear(decode, q, scales, b), weight_only_linear_reference(decode, q, scales, b))
    assert not torch.equal(fp8_linear(decode, q, scales, b), w8a8_linear_reference(decode, q, scales, b))


def test_x_of_another_dtype_is_refused():
    x, q, scales, _ = operands(2, 16, 32, torch.float16, seed=0)
    with pytest.raises(ValueError, match="must be a float"):
        w8a16_linear(x.to(torch.int32), q, scales)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a16_linear(x, q, scales[:8])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (1000, 4608)])
def test_w8a16_on_the_gpu_at_llama_8b_shapes(dtype: torch.dtype, num_tokens: int, n: int, k: int):
    x, q, scales, b = operands(num_tokens, n, k, dtype, seed=num_tokens)
    y = w8a16_linear(x, q, scales, b)
    assert_within_rounding(y.cpu(), x.cpu(), q.cpu(), scales.cpu(), b.cpu())
    assert torch.equal(y, w8a16_linear(x, q, scales, b))  # the split sums in a fixed order
