"""Weight-only FP8 GEMM for decode sizes (W8A16; reference.py's weight_only_linear_reference is the
oracle):

    y[t, n] = (sum_k x[t, k] * q_w[n, k]) * s_w[n] (+ bias[n])     x bf16/fp16/fp32, fp32 accumulation

At a few dozen tokens a projection is bound by reading its weight, and W8A8 would pay a per-token
quantization launch and a scaled GEMM tuned for large M to save compute nobody is short of. Here the
fp8 weight tile is read once, widened to x's dtype in registers and multiplied on the tensor cores;
the per-channel scale is applied once, on the fp32 sum. The activations are not quantized.

Widening goes through fp16 (e4m3 → fp16 is one hardware conversion per two values; every e4m3 value
is exact in fp16 and in bf16): Triton's direct e4m3 → bf16 conversion is a longer instruction
sequence, and at HBM speed the conversion, not the load, was what limited the kernel (numbers:
docs/benchmarks.md, "Quantized bases").

Grid: (N tiles, M tiles, SPLIT_K). The tile is x [BLOCK_M, BLOCK_K] · w [BLOCK_N, BLOCK_K]ᵀ, or with
the operands swapped (w · xᵀ) the weight's rows are the MMA's M side and the tokens its N side. Where
the tiles are too few to keep every SM reading weights, the K reduction is split. Split partials go
to an fp32 workspace and a second kernel sums them in a fixed order (deterministic, no atomics, no
zero fill). The launch (tiles, split, order, warps, stages) is a W8A16Plan: tuned per GPU model and
weight shape where a table has one, else a default (w8a16_plans.py).

Plans of 16-row tiles (up to 16 tokens: the kernel only streams weights) launch with PDL (kernels/pdl.py):
the GEMM's programs are scheduled while the kernel ahead of them (the norm, attention or activation
that writes x) finishes, and the split sum's while the GEMM finishes. The GEMM itself lets its
successor be scheduled only when it ends; that, and no PDL for the wider plans, is what measured
fastest on an H100 (docs/benchmarks.md, "Quantized bases").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.reference import FP8_DTYPE
from kernels.quant.w8a16_plans import W8A16Plan, default_plan, plan_for


@functools.cache
def _device(index: int) -> tuple[str, int]:
    """(name, SM count) of a CUDA device: what its plans are looked up by."""
    return torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index).multi_processor_count


def plan_for_tensor(x: torch.Tensor, n: int) -> W8A16Plan:
    """The plan w8a16_linear takes for x [M, K] against a weight [n, K]: the tuned one of x's GPU
    (w8a16_plans.py), else the default; through the interpreter, the default for an H100's 132 SMs."""
    num_tokens, k = x.shape
    if not x.is_cuda:
        return default_plan(num_tokens, n, k, num_sms=132)
    name, sms = _device(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return plan_for(name, num_tokens, n, k, sms)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile serves every token count
def _w8a16_kernel(
    out_ptr,  # [M, N] x's dtype, or (PARTIAL) float32 partials [SPLIT_K, M, N]
    x_ptr,  # [M, K] bf16/fp16/fp32, last axis contiguous
    w_ptr,  # fp8 e4m3 [N, K], contiguous
    scale_ptr,  # float32 [N]
    bias_ptr,  # [N] x's dtype, or x_ptr when HAS_BIAS is off (never read)
    num_tokens,
    n_size,
    k_size,
    k_per_split,  # a multiple of BLOCK_K
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,  # acc [BLOCK_N, BLOCK_M] = w · xᵀ instead of acc [BLOCK_M, BLOCK_N] = x · wᵀ
    PARTIAL: tl.constexpr,  # the K reduction is split: write fp32 partials, no scale sum or bias yet
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # float32 activations (the demo model's GPU dtype): no TF32 rounding of x
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL, SCHEDULE_NEXT=False)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < num_tokens, cols < n_size
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * k_size + ks[None, :]  # [BLOCK_N, BLOCK_K]
    if SWAP:
        x_ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_x + ks[:, None]  # xᵀ [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k in range(k_start, tl.minimum(k_start + k_per_split, k_size), BLOCK_K):
        k_ok = k + ks < k_size
        w = tl.load(w_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w = w.to(tl.float16).to(x_ptr.dtype.element_ty)  # exact; see the module docstring for why via fp16
        if SWAP:
            x = tl.load(x_ptrs + k, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            acc = tl.dot(w, x, acc, input_precision="ieee") if IEEE else tl.dot(w, x, acc)
        else:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee") if IEEE else tl.dot(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * n_size + cols[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * num_tokens * n_size + offsets, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    y_ptr,  # [M * N] x's dtype
    partials_ptr,  # float32 [SPLIT_K, M * N]
    bias_ptr,  # [N], or y_ptr when HAS_BIAS is off (never read)
    size,  # M * N
    n_size,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # a fixed order: the same sum on every run
        total += tl.load(partials_ptr + split * size + offsets, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offsets % n_size, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=ok)


def w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: W8A16Plan | None = None,
) -> torch.Tensor:
    """y [M, N] in x's dtype for x [M, K] (bf16/fp16/fp32, contiguous last axis), the fp8 weight [N, K]
    (contiguous) with float32 per-channel scales [N] and bias [N] or None; `plan` None: plan_for_tensor."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"w8a16_linear: x {tuple(x.shape)} {x.dtype} must be a float [M, K], last axis contiguous")
    num_tokens, k_size = x.shape
    n_size = weight.shape[0]
    if weight.dtype != FP8_DTYPE or weight.shape != (n_size, k_size) or not weight.is_contiguous():
        raise ValueError(f"w8a16_linear: weight {tuple(weight.shape)} {weight.dtype} must be contiguous "
                         f"{FP8_DTYPE} [N, K={k_size}]")  # fmt: skip
    if weight_scale.dtype != torch.float32 or weight_scale.shape != (n_size,):
        raise ValueError(f"w8a16_linear: weight_scale {tuple(weight_scale.shape)} must be float32 [N={n_size}]")
    y = torch.empty((num_tokens, n_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    if plan is None:
        plan = plan_for_tensor(x, n_size)
    k_per_split = triton.cdiv(k_size, plan.split_k * plan.block_k) * plan.block_k
    split_k = triton.cdiv(k_size, k_per_split)  # rounding K ranges up to BLOCK_K may need fewer
    out = y if split_k == 1 else torch.empty((split_k, num_tokens, n_size), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_size, plan.block_n), triton.cdiv(num_tokens, plan.block_m), split_k)
    launch_pdl = pdl.launch_options(x.device, num_tokens) if plan.block_m == 16 else pdl.NO_PDL
    _w8a16_kernel[grid](
        out, x, weight, weight_scale, x if bias is None else bias,
        num_tokens, n_size, k_size, k_per_split, x.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        SWAP=plan.swap, PARTIAL=split_k > 1, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **launch_pdl,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(y.numel(), block),)](
            y, out, y if bias is None else bias, y.numel(), n_size,
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **launch_pdl,
        )  # fmt: skip
    return y
