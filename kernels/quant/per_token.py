"""Per-token dynamic FP8 quantization of activations as one Triton kernel (reference.py's
quantize_per_token_reference is the oracle):

    for each token t:  s[t] = max(max_k |x[t, k]|, FP8_MAX * MIN_SCALE) / FP8_MAX
                       q[t, k] = fp8(clamp(x[t, k] / s[t], -FP8_MAX, FP8_MAX))

Grid: one program per token; it reads the row twice (the maximum, then the quantization), the
second read from L2 at activation sizes. Torch would take four kernels (abs, amax, divide, cast).
The kernel rounds to the e4m3 grid itself (to nearest, ties to even, as the hardware and torch
convert) and then casts an exact value: Triton's interpreter converts inexact values to fp8 wrongly
(a carry into the next power of two is lost), so this is what makes the interpreter tests exact.
It casts the magnitude and sets the sign bit from x itself: compiled for the GPU, the cast turned a
negative value that rounds to zero into +0 where torch writes -0 (0x80), the one difference from the
reference on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.reference import FP8_DTYPE, FP8_MAX, MIN_SCALE

# 1.5 * 2**23: adding and subtracting it rounds an fp32 of magnitude below 2**22 to an integer, ties to even
_ROUNDER = tl.constexpr(12582912.0)  # a global a jitted function reads must be a constexpr


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even: the grid's step is
    2**(exponent - 3) for normal values and 2**-9 for subnormals (below 2**-6)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.math.div_rn(tl.abs(v), step) + _ROUNDER) - _ROUNDER) * step
    return tl.where(bits < 0, -magnitude, magnitude)  # the sign bit: -0 and what rounds to zero stay negative


@triton.jit
def saturate_to_e4m3(v):
    """v clamped to the fp8 range and rounded to the e4m3 grid, in fp32: exact when cast to fp8."""
    return round_to_e4m3(tl.clamp(v.to(tl.float32), -448.0, 448.0))


@triton.jit
def to_e4m3_signed_as(v, sign_source, dtype: tl.constexpr):
    """v (fp32 on the e4m3 grid, |v| <= FP8_MAX) as fp8 `dtype`, its sign bit sign_source's (an fp32
    of the same sign, -0 included): the magnitude is cast, the sign set on the byte."""
    magnitude = tl.abs(v).to(dtype).to(tl.uint8, bitcast=True)
    sign = ((sign_source.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return (magnitude | sign).to(dtype, bitcast=True)


@triton.jit
def _quantize_per_token_kernel(
    q_ptr,  # fp8 [T, K], contiguous
    scale_ptr,  # float32 [T, 1]
    x_ptr,  # [T, K], last axis contiguous
    num_cols,
    stride_x,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    row = x_ptr + token * stride_x
    cols = tl.arange(0, BLOCK)
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        x = tl.load(row + start + cols, mask=start + cols < num_cols, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    # correctly rounded divisions (a compiled `/` is approximate): bit for bit what torch computes
    scale = tl.maximum(tl.math.div_rn(tl.max(peak, axis=0), FP8_MAX_), MIN_SCALE_)
    tl.store(scale_ptr + token, scale)
    out = q_ptr + token * num_cols
    for start in range(0, num_cols, BLOCK):
        mask = start + cols < num_cols
        x = tl.load(row + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_))
        tl.store(out + start + cols, to_e4m3_signed_as(q, x, q_ptr.dtype.element_ty), mask=mask)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, K] contiguous, float32 scales [T, 1]) for x [T, K] with a contiguous last axis."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_per_token: x {tuple(x.shape)} must be [T, K] with a contiguous last axis")
    num_tokens, num_cols = x.shape
    q = torch.empty((num_tokens, num_cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens:
        _quantize_per_token_kernel[(num_tokens,)](
            q,
            scales,
            x,
            num_cols,
            x.stride(0),
            FP8_MAX_=FP8_MAX,
            MIN_SCALE_=MIN_SCALE,
            BLOCK=min(triton.next_power_of_2(num_cols), 2048),
            **pdl.launch_options(x.device, num_tokens),
            num_warps=4,
        )
    return q, scales
