"""FP8 weights (kernels/quant): the per-token quantization kernel against its torch reference (bit for
bit: fp32/fp16 inputs through the interpreter, bf16 on the GPU), the per-channel weight scales'
error bound, and the fp8 GEMM (W8A16 at decode sizes, W8A8 past them) under every LoRA path against
the dequantized reference (GPU). The W8A16 kernel's own tests: test_w8a16.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.lora import linear_deferred_with_plan, linear_with_plan, lora_linear
from kernels.lora.configs import GatherConfig, default_plan
from kernels.quant import FP8_DTYPE, W8A16_MAX_TOKENS, dequantize, fp8_linear, quantize_weight
from kernels.quant.per_token import quantize_per_token_triton
from kernels.quant.reference import FP8_MAX, fp8_linear_reference, quantize_per_token_reference
from tests.kernels.lora_cases import make_case, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def activations(num_tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of different magnitudes, a row of zeros and a row of values small enough for subnormals."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, width, generator=generator) * torch.logspace(-2, 2, num_tokens)[:, None]
    x[0] = 0.0
    if num_tokens > 2:
        x[1, 1:] *= 1e-4  # one large element: the rest of the row falls below fp8's normal range
    return x.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "width"), [(1, 64), (5, 1000), (3, 4608)])
def test_per_token_kernel_matches_the_reference_bit_for_bit(dtype: torch.dtype, num_tokens: int, width: int):
    x = activations(num_tokens, width, dtype, seed=width)
    q, scales = quantize_per_token_triton(x)
    q_ref, scales_ref = quantize_per_token_reference(x)
    assert q.dtype == FP8_DTYPE and scales.shape == (num_tokens, 1)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # -0 and subnormals included


def test_per_token_kernel_reads_a_row_strided_view():
    x = activations(4, 300, torch.float32, seed=1)
    wide = torch.zeros(4, 512, device=DEVICE)
    wide[:, :300] = x
    q, _ = quantize_per_token_triton(wide[:, :300])
    assert torch.equal(q.view(torch.uint8), quantize_per_token_triton(x)[0].view(torch.uint8))


def test_weight_scales_are_per_output_channel():
    # a channel of small weights beside a channel of large ones keeps its own relative precision
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 256, generator=generator) * torch.tensor([[1e-3], [1.0], [30.0], [0.1]])
    q, scales = quantize_weight(weight)
    assert q.dtype == FP8_DTYPE and scales.shape == (4,)
    assert torch.allclose(scales, weight.abs().amax(dim=1) / FP8_MAX)
    error = (dequantize(q, scales) - weight).abs()
    # round to nearest: half a step, 2**-4 of a normal value's magnitude, 2**-10 * scale in the subnormals
    bound = torch.maximum(weight.abs() * 2**-4, scales[:, None] * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("num_tokens", [9, W8A16_MAX_TOKENS + 6])
def test_lora_linear_adds_the_delta_on_top_of_the_fp8_base_on_cpu(num_tokens: int):
    case = make_case(num_tokens, 64, [32, 16], [8, 0, 4], dtype=torch.float32, device="cpu", seed=5)
    q, scales = quantize_weight(case.weight)
    y = lora_linear(case.x, q, case.bias, case.lora_a, case.lora_b, case.batch, weight_scale=scales)
    expected = case.delta(fp8_linear_reference(case.x, q, scales, case.bias))
    assert torch.allclose(y, expected, atol=1e-5, rtol=1e-5)
    assert y.dtype == case.x.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 33, W8A16_MAX_TOKENS, W8A16_MAX_TOKENS + 1, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_the_dequantized_reference(num_tokens: int, bias: bool):
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 1024, generator=generator).to("cuda", torch.bfloat16)
    q, scales = quantize_weight(torch.randn(768, 1024, generator=generator).to("cuda") * 0.02)
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16) if bias else None
    # W8A16 (the Triton kernel) or W8A8 (torch._scaled_mm) against the reference of the same rule: both
    # sum the same products in fp32; they differ by accumulation order and the output's rounding
    assert rel_err(fp8_linear(x, q, scales, b), fp8_linear_reference(x, q, scales, b)) < 1e-2


PATHS = [("fused", None), ("split", None), ("split", GatherConfig()), ("overlap", None)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 40, 600])  # W8A16 below W8A16_MAX_TOKENS, W8A8 above
@pytest.mark.parametrize(("path", "expand"), PATHS)
def test_every_lora_path_adds_its_delta_to_the_fp8_base(path: str, expand: GatherConfig | None, num_tokens: int):
    case = make_case(num_tokens, 1024, [1024, 256, 256], [16, 8, 0, 32], dtype=torch.bfloat16, device="cuda",
                     page_rank=16, seed=num_tokens)  # fmt: skip
    q, scales = quantize_weight(case.weight)
    plan = dataclasses.replace(default_plan(num_tokens, 32), path=path, gather=expand)
    expected = case.delta(fp8_linear_reference(case.x.float(), q, scales, case.bias))
    y = linear_with_plan(plan, case.x, q, case.bias, case.lora_a, case.lora_b, case.batch, weight_scale=scales)
    assert rel_err(y, expected) < 1e-2
    base, delta = linear_deferred_with_plan(
        plan, case.x, q, case.bias, case.lora_a, case.lora_b, case.batch, weight_scale=scales
    )
    assert rel_err(base if delta is None else base.float() + delta.float(), expected) < 1e-2
