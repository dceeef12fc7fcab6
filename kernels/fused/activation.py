"""SiLU(gate) · up over the merged gate_up projection output, as one Triton kernel.

    g = gate_up (+ delta, rounded to the dtype: a LoRA delta computed beside the projection)
    out[t, i] = (silu(g[t, i]).to(dtype) * g[t, I + i]).to(dtype)     i < I

Grid: (tokens, column tiles); each program reads its tile of gate and of up once and writes out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    gate_up_ptr,  # [T, 2I]
    delta_ptr,  # [T, 2I], read when HAS_DELTA
    width,  # I
    stride_out,
    stride_gate_up,
    stride_delta,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    gate_ptrs = gate_up_ptr + row * stride_gate_up + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + width, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta_ptrs = delta_ptr + row * stride_delta + cols
        gate = (gate + tl.load(delta_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        up = (up + tl.load(delta_ptrs + width, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    # rounded where torch rounds F.silu's result, before the product
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (columns contiguous), plus delta [T, 2I] when given → [T, I]."""
    num_tokens, double_width = gate_up.shape
    if double_width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} must be [T, 2I] with contiguous columns")
    if delta is not None and (delta.shape != gate_up.shape or delta.stride(1) != 1 or delta.dtype != gate_up.dtype):
        raise ValueError(f"silu_and_mul: delta {tuple(delta.shape)} {delta.dtype} does not match gate_up")
    width = double_width // 2
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
        out,
        gate_up,
        gate_up if delta is None else delta,
        width,
        out.stride(0),
        gate_up.stride(0),
        gate_up.stride(0) if delta is None else delta.stride(0),
        HAS_DELTA=delta is not None,
        BLOCK=block,
        **pdl.launch_options(gate_up.device, num_tokens),
        num_warps=4,
    )
    return out
