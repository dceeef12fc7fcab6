"""The MoE layer's last step with its down LoRA delta added: one pass over both per-pair outputs.

Semantics:
    out[t, :] = sum over k of (y[t * top_k + k, :] + delta[t * top_k + k, :])     (float32 sum)

`delta` is the down projection's LoRA delta, computed on a side stream beside the down GEMM
(fused.py), so adding it here costs no pass of its own. Grid: (tokens, column tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit(do_not_specialize=["width"])
def _topk_sum_kernel(y_ptr, delta_ptr, out_ptr, width, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = (token * TOP_K + k) * width
        acc += tl.load(y_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(delta_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def topk_sum(y: torch.Tensor, delta: torch.Tensor, top_k: int) -> torch.Tensor:
    """y, delta [T * top_k, H] contiguous, same dtype → [T, H] in that dtype."""
    if y.shape != delta.shape or y.dtype != delta.dtype or not (y.is_contiguous() and delta.is_contiguous()):
        raise ValueError(f"y {tuple(y.shape)} {y.dtype} and delta {tuple(delta.shape)} {delta.dtype} must match")
    if y.shape[0] % top_k:
        raise ValueError(f"{y.shape[0]} pair rows are not a multiple of top_k {top_k}")
    num_tokens, width = y.shape[0] // top_k, y.shape[1]
    out = torch.empty(num_tokens, width, dtype=y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(width))
    _topk_sum_kernel[(num_tokens, triton.cdiv(width, block))](
        y, delta, out, width, TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out
