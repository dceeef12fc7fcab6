"""FP8 (e4m3) quantization in plain torch: the semantics the Triton kernel and torch._scaled_mm
reproduce, and the path taken on CPU (which has fp8 storage but no fp8 matmul: it dequantizes).

    quantize_per_token:  s[t] = max(|x[t, :]|) / FP8_MAX (at least MIN_SCALE);  q[t] = fp8(x[t] / s[t])
    quantize_weight:     s[n] = max(|w[n, :]|) / FP8_MAX (at least MIN_SCALE);  q[n] = fp8(w[n] / s[n])
    fp8_linear (T tokens):
        W8A8,  T > W8A16_MAX_TOKENS:   y[t, n] = (q_x[t] · q_w[n]) * s_x[t] * s_w[n] (+ bias[n])
        W8A16, T <= W8A16_MAX_TOKENS:  y[t, n] = (x[t] · q_w[n]) * s_w[n] (+ bias[n])    both in fp32
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Decode sizes: a GEMM of up to this many tokens keeps its activations unquantized (W8A16), where the
# weight's bytes set the time (a bf16 tensor core does 2 * 64 flops per weight byte in the time HBM
# delivers about one: compute-bound only past ~80 tokens on H100/H200), so activation quantization
# would cost a launch and accuracy and save nothing; above it, W8A8's fp8 tensor cores win.
# `python -m bench.quant_kernels` prints both beside their rooflines at each size.
W8A16_MAX_TOKENS = 64
# the smallest scale: a row of zeros quantizes to zeros instead of dividing by zero; small enough that
# any row with a normal bf16 element keeps its full fp8 range
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def to_fp8_saturated(x: torch.Tensor) -> torch.Tensor:
    """x in fp8, values past the fp8 range clamped to it (a plain cast would make them NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def rowwise_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 [R, 1]: each row's absolute maximum of x [R, K] over FP8_MAX (a correctly rounded
    division), at least MIN_SCALE."""
    peak = x.abs().amax(dim=-1, keepdim=True).float()
    # the divisor is a tensor, not a Python number: CUDA torch turns a division by a host scalar into
    # a multiplication by its reciprocal (1/448 is inexact, so a scale can land one ulp off the quotient
    # the Triton kernel computes); a tensor divisor is a true division on every device
    return (peak / torch.full_like(peak, FP8_MAX)).clamp_(min=MIN_SCALE)


def quantize_rows(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [R, K]: x [R, K] divided by its rows' scales [R, 1] (in fp32), clamped to the fp8 range."""
    return (x.float() / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, K], float32 scales [T, 1]) for activations x [T, K]: one dynamic scale per token."""
    scales = rowwise_scales(x)
    return quantize_rows(x, scales), scales


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scales [N]) for weight [N, K]: one scale per output channel, so a channel
    of small weights keeps its precision beside a channel of large ones (per-tensor scales lose
    measurable accuracy on fine-tuned tasks). Runs on the weight's device."""
    scales = rowwise_scales(weight)
    return quantize_rows(weight, scales), scales.squeeze(1)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [R, K]: fp8 q [R, K] times its rows' scales ([R] or [R, 1])."""
    return q.float() * scales.reshape(-1, 1)


def check_block_scales(weight_shape: tuple[int, ...], scales_shape: tuple[int, ...], block: tuple[int, int]) -> None:
    """Raises ValueError unless scales of `scales_shape` are one per block of block[0] outputs ×
    block[1] inputs of a weight [N, K]: [ceil(N / block[0]), ceil(K / block[1])]."""
    (n, k), (rows, columns) = weight_shape, block
    if tuple(scales_shape) != (-(-n // rows), -(-k // columns)):
        raise ValueError(
            f"block scales {tuple(scales_shape)} do not cover a [{n}, {k}] weight in blocks of {rows}×{columns}"
        )


def dequantize_blocks(q: torch.Tensor, block_scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K]: a block-wise fp8 weight q [N, K] times the scale of its block of block[0]
    outputs × block[1] inputs, block_scales [ceil(N / block[0]), ceil(K / block[1])]."""
    check_block_scales(tuple(q.shape), tuple(block_scales.shape), block)
    (n, k), (rows, columns) = q.shape, block
    per_weight = block_scales.float().repeat_interleave(rows, dim=0)[:n].repeat_interleave(columns, dim=1)[:, :k]
    return q.float() * per_weight


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (any float dtype) → [T, N] in x's dtype through the fp8 weight [N, K] with its float32
    per-channel scales [N] (and bias [N]): W8A16 for T <= W8A16_MAX_TOKENS, else W8A8."""
    if x.shape[0] <= W8A16_MAX_TOKENS:
        return weight_only_linear_reference(x, weight, weight_scale, bias)
    return w8a8_linear_reference(x, weight, weight_scale, bias)


def w8a8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] quantized per token, times the fp8 weight [N, K] with its float32 per-channel scales [N],
    in fp32 (the dequantized form of the same sum torch._scaled_mm accumulates), plus bias [N]; in x's
    dtype."""
    q, scales = quantize_per_token_reference(x)
    y = dequantize(q, scales) @ dequantize(weight, weight_scale).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def weight_only_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (any float dtype, not quantized) → [T, N] in x's dtype: x times the fp8 weight [N, K]
    with its float32 per-channel scales [N], in fp32 (what w8a16.py computes), plus bias [N]."""
    y = x.float() @ dequantize(weight, weight_scale).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
