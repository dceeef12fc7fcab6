"""FP8 (e4m3) quantization in plain torch: the semantics the Triton kernel and torch._scaled_mm
reproduce, and the path taken on CPU (which has fp8 storage but no fp8 matmul: it dequantizes).

    quantize_per_token:  s[t] = max(|x[t, :]|) / FP8_MAX (at least MIN_SCALE);  q[t] = fp8(x[t] / s[t])
    quantize_weight:     s[n] = max(|w[n, :]|) / FP8_MAX (at least MIN_SCALE);  q[n] = fp8(w[n] / s[n])
    fp8_linear:          y[t, n] = (q_x[t] · q_w[n]) * s_x[t] * s_w[n] (+ bias[n])    accumulated in fp32
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# the smallest scale: a row of zeros quantizes to zeros instead of dividing by zero; small enough that
# any row with a normal bf16 element keeps its full fp8 range
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def to_fp8_saturated(x: torch.Tensor) -> torch.Tensor:
    """x in fp8, values past the fp8 range clamped to it (a plain cast would make them NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def rowwise_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 [R, 1]: each row's absolute maximum of x [R, K] over FP8_MAX, at least MIN_SCALE."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_SCALE)


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


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (any float dtype) → [T, N] in x's dtype: x quantized per token, times the fp8 weight
    [N, K] with its float32 per-channel scales [N], in fp32 (the dequantized form of the same sum
    torch._scaled_mm accumulates), plus bias [N]."""
    q, scales = quantize_per_token_reference(x)
    y = dequantize(q, scales) @ dequantize(weight, weight_scale).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
