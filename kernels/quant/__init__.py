"""FP8 (e4m3) weights for the base model's projections: W8A8 above decode sizes, W8A16 at them.

Semantics (reference.py is the oracle): the weight [N, K] is held in fp8 with one float32 scale per
output channel. A GEMM of more than W8A16_MAX_TOKENS tokens (prefill) quantizes each token's
activations with its own dynamic scale and runs on the fp8 tensor cores (W8A8); one of at most
W8A16_MAX_TOKENS tokens (decode) keeps its activations in their dtype (W8A16), where the weight's bytes,
not the flops, set the time:

    W8A8   (T > W8A16_MAX_TOKENS):  y[t, n] = (q_x[t] · q_w[n]) * s_x[t] * s_w[n] (+ bias[n])
    W8A16  (T <= W8A16_MAX_TOKENS): y[t, n] = (x[t] · q_w[n]) * s_w[n] (+ bias[n])      both in fp32

The rule is the token count's, on every device, so the CPU engine computes what the GPU engine
computes. CUDA tensors take the Triton per-token quantization (per_token.py) and torch._scaled_mm's
rowwise scaled GEMM (FP8 tensor cores, Ada and Hopper), or the Triton W8A16 GEMM (w8a16.py);
anything else takes the torch references, which dequantize (a CPU has fp8 storage but no fp8
matmul). Adapters are not quantized: the LoRA kernels read the unquantized activations and add their
delta on top of this base GEMM.
"""

from __future__ import annotations

import torch

from kernels.quant.int4 import int4_linear, takes_tinygemm
from kernels.quant.int4_reference import Int4Weight
from kernels.quant.per_token import quantize_per_token_triton
from kernels.quant.reference import (
    FP8_DTYPE,
    W8A16_MAX_TOKENS,
    dequantize,
    fp8_linear_reference,
    quantize_per_token_reference,
    quantize_weight,
)
from kernels.quant.w8a16 import w8a16_linear

__all__ = [
    "FP8_DTYPE",
    "W8A16_MAX_TOKENS",
    "Int4Weight",
    "base_linear",
    "dequantize",
    "fp8_linear",
    "int4_linear",
    "quantize_per_token",
    "quantize_weight",
    "takes_tinygemm",
    "w8a8_linear",
    "w8a16_linear",
]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, K], float32 scales [T, 1]) for activations x [T, K]."""
    if x.is_cuda:
        return quantize_per_token_triton(x)
    return quantize_per_token_reference(x)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] → [T, N] in x's dtype, for the fp8 weight [N, K] with float32 per-channel scales [N]:
    W8A16 for T <= W8A16_MAX_TOKENS, else W8A8 (the module docstring)."""
    if not x.is_cuda:
        return fp8_linear_reference(x, weight, weight_scale, bias)
    if x.shape[0] <= W8A16_MAX_TOKENS:
        return w8a16_linear(x, weight, weight_scale, bias)
    return w8a8_linear(x, weight, weight_scale, bias)


def w8a8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The W8A8 GEMM on CUDA at any token count (fp8_linear takes it past decode sizes): x [T, K]
    quantized per token, then torch._scaled_mm against the fp8 weight [N, K]; [T, N] in x's dtype."""
    q, scales = quantize_per_token_triton(x)
    # rowwise scaling: scale_a [T, 1] and scale_b [1, N], both float32 and contiguous; the second
    # operand column-major (the weight's transpose, a view); the output bf16, the only dtype the
    # rowwise kernels write
    y = torch._scaled_mm(q, weight.t(), scale_a=scales, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
    if bias is not None:
        y += bias
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def base_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
) -> torch.Tensor:
    """x [T, K] @ weight[N, K].T (+ bias): the W4A16 GEMM for a 4-bit weight (int4.py), an fp8 GEMM
    when the weight has scales [N], else F.linear."""
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight, bias)
    if weight_scale is None:
        return torch.nn.functional.linear(x, weight, bias)
    return fp8_linear(x, weight, weight_scale, bias)
