"""The fused MoE grouped GEMM: every active expert's projection over its routed pairs, one launch.

Semantics:
    for each pair p = t * top_k + k routed to expert e (blocks from align.py, grouped by expert):
        out[p, :] = a[p // rows_div] @ W[e].T  (* scale[e] if given) (* weights[p] if weights is given)
rows_div = top_k when a holds tokens (gate_up reads x once per pair), 1 when a holds pairs (down
reads each pair's activation). Output rows of pairs are independent: the top-k sum is the caller's.

FP8 experts (W8A16): W is float8_e4m3fn with one float32 scale per expert and output channel,
scale [E, N]. Each weight tile is widened to a's dtype in registers (exact: every e4m3 value is a
bf16 and an fp16 value) and multiplied in a's dtype with fp32 accumulation; the scale, constant
along K, multiplies the finished tile once. Activations are never quantized.

Grid: one program per (block of BLOCK_M pairs of one expert, BLOCK_N columns), ordered in groups
of GROUP_M row blocks that walk the N tiles together, so a group's expert weights stay in L2.
Blocks past the last used one exit at once (the grid is sized for the worst case, so it never
depends on data and needs no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.configs import GemmConfig
from kernels.moe.pair_blocks import PairBlocks
from kernels.quant.reference import FP8_DTYPE


@triton.jit
def swizzle(pid, num_blocks, num_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid`, GROUP_M row blocks at a time."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, scale_ptr, sorted_pairs_ptr, block_groups_ptr,
    num_pairs, num_blocks, n_size, k_size, rows_div,
    a_stride, w_stride_e, w_stride_n, out_stride,
    MUL_WEIGHT: tl.constexpr, FP8_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = swizzle(tl.program_id(0), num_blocks, tl.cdiv(n_size, BLOCK_N), GROUP_M)
    expert = tl.load(block_groups_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = (pairs // rows_div).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_size
    k_offs = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * a_stride + k_offs[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert.to(tl.int64) * w_stride_e + n[None, :] * w_stride_n + k_offs[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k, mask=pair_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k + k_offs) < k_size
            a = tl.load(a_ptrs + k, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8_W:
            w = w.to(a_ptr.dtype.element_ty)
        acc += tl.dot(a, w)
    if FP8_W:
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * n_size + n, mask=n_ok, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * out_stride + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    blocks: PairBlocks,
    rows_div: int,
    config: GemmConfig,
    weights: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [T or P, K] (unit column stride), w [E, N, K] contiguous → out [P, N] in a's dtype.

    weights: float32 [P] routing weight per pair, multiplied into each output row when given.
    scale: float32 [E, N] contiguous, the per-output-channel scales of an fp8 w (given iff w is fp8).
    blocks.block_m must equal config.block_m."""
    if blocks.block_m != config.block_m:
        raise ValueError(f"pair blocks of {blocks.block_m} rows, config wants {config.block_m}")
    _, n_size, k_size = w.shape
    if a.shape[1] != k_size or a.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"a {tuple(a.shape)} and w {tuple(w.shape)} do not chain (or are not contiguous)")
    fp8 = w.dtype == FP8_DTYPE
    if fp8 != (scale is not None):
        given = "no scale" if scale is None else "a scale"
        raise ValueError(f"w of {w.dtype} with {given}: an fp8 w needs its scales, and only an fp8 w takes them")
    if scale is not None and (scale.shape != w.shape[:2] or scale.dtype != torch.float32 or not scale.is_contiguous()):
        raise ValueError(f"scale must be contiguous float32 {tuple(w.shape[:2])}, not {scale.dtype} {scale.shape}")
    out = torch.empty(blocks.num_pairs, n_size, dtype=a.dtype, device=a.device)
    if blocks.num_pairs == 0:
        return out
    grid = (blocks.max_blocks * triton.cdiv(n_size, config.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, out if weights is None else weights, out if scale is None else scale,
        blocks.sorted_pairs, blocks.block_groups,
        blocks.num_pairs, blocks.max_blocks, n_size, k_size, rows_div,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None, FP8_W=fp8,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, EVEN_K=k_size % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
