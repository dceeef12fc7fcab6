"""RMSNorm, optionally after adding the residual stream, as one Triton kernel: one program per token
row, the whole row in registers (hidden sizes up to 16K).

    with residual:  residual[t] = x[t] + residual[t]        (rounded to the dtype, written in place)
                    out[t] = weight * (residual[t] / rms(residual[t])).to(dtype)
    without:        out[t] = weight * (x[t] / rms(x[t])).to(dtype)

The sum of squares is in float32; rounding happens where HF's modules round (reference.py), so bf16
results match the torch path up to the order of the reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

_MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, hidden]
    x_ptr,  # [T, hidden]
    residual_ptr,  # [T, hidden], read and written when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    hidden,
    eps,
    stride_out,
    stride_x,
    stride_residual,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + cols
        x = (x.to(tl.float32) + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(residual_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """out [T, hidden] for x [T, hidden] (rows may be strided, columns contiguous) and weight [hidden];
    with `residual` [T, hidden] the input is x + residual, which is also written into `residual`."""
    num_tokens, hidden = x.shape
    if hidden > _MAX_HIDDEN or weight.shape != (hidden,) or x.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        out,
        x,
        x if residual is None else residual,
        weight,
        hidden,
        eps,
        out.stride(0),
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        **pdl.launch_options(x.device, num_tokens),
        num_warps=min(max(block // 512, 1), 16),
    )
    return out
