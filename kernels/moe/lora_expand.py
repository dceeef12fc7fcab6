"""MoE-LoRA expand, fused with the add: out[p] += scale[s] * z[p] @ B[s, expert]ᵀ (* weights[p]).

Semantics:
    for each pair p with adapter slot s >= 0 and expert e (blocks from align.adapter_expert_blocks):
        out[p, :] += scale[s] * (sum over splits of z[:, p, :R]) @ B[s, e].T   (* weights[p] if given)
    other rows of out are untouched.

`out` is the base grouped GEMM's output, so the LoRA delta lands in the same buffer with no extra
pass: each (pair, column) belongs to exactly one block and one column tile, so the read-add-write
needs no atomics. With the down projection the routing weight the base GEMM applied is applied to
the delta too. Grid and block ordering as in gemm.py (B[s, e] plays the expert weight), except that a program
walks config.n_tiles column tiles of BLOCK_N with z loaded once: at prefill sizes (~100 pairs a
group) one program over a whole half of gate_up or all of down beats a program per tile
(docs/benchmarks.md, "Figures behind code comments"); at decode sizes the tile per program wins.

block_diagonal: B [N, R] is [[B_0, 0], [0, B_1]] (gate and up LoRAs stacked, rank R/2 each), so a
program in the first N/2 columns reads only ranks [0, R/2) of z and B, one in the second half only
[R/2, R): half the B bytes and half the dot. A program's columns must not straddle N/2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.configs import GemmConfig
from kernels.moe.gemm import swizzle
from kernels.moe.lora_shrink import rank_pad
from kernels.moe.pair_blocks import PairBlocks


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "z_stride_split"])
def _moe_expand_kernel(
    z_ptr, lora_b_ptr, out_ptr, scales_ptr, weights_ptr, sorted_pairs_ptr, block_groups_ptr,
    num_pairs, num_blocks, num_experts, n_size, rank, split_k,
    z_stride_split, z_stride_pair, out_stride,
    MUL_WEIGHT: tl.constexpr, BLOCK_DIAGONAL: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, N_TILES: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = swizzle(tl.program_id(0), num_blocks, tl.cdiv(n_size, BLOCK_N * N_TILES), GROUP_M)
    group = tl.load(block_groups_ptr + pid_m)
    if group < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    n_start = pid_n * BLOCK_N * N_TILES
    if BLOCK_DIAGONAL:
        used = rank // 2
        r0 = tl.where(n_start >= n_size // 2, used, 0)
    else:
        used = rank
        r0 = 0
    r = r0 + tl.arange(0, R_PAD)
    r_ok = r < r0 + used
    z_ptrs = z_ptr + pairs.to(tl.int64)[:, None] * z_stride_pair + r[None, :]
    z = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for split in range(split_k):
        z += tl.load(z_ptrs + split * z_stride_split, mask=pair_ok[:, None] & r_ok[None, :], other=0.0)
    z = z.to(lora_b_ptr.dtype.element_ty)
    row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(scales_ptr + group // num_experts)
    if MUL_WEIGHT:
        row_scale *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)
    b_ptrs = lora_b_ptr + group.to(tl.int64) * n_size * rank + r[:, None]  # [R_PAD, 1]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * out_stride  # [BLOCK_M, 1]
    for tile in range(N_TILES):  # z stays in registers across the program's column tiles
        n = n_start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_size
        b = tl.load(b_ptrs + n[None, :] * rank, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R_PAD, BLOCK_N]
        delta = tl.dot(z, b) * row_scale[:, None]
        mask = pair_ok[:, None] & n_ok[None, :]
        base = tl.load(out_ptrs + n[None, :], mask=mask, other=0.0)
        tl.store(out_ptrs + n[None, :], (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def moe_lora_expand(
    out: torch.Tensor,
    z: torch.Tensor,
    lora_b: torch.Tensor,
    slot_scales: torch.Tensor,
    blocks: PairBlocks,
    config: GemmConfig,
    weights: torch.Tensor | None = None,
    block_diagonal: bool = False,
) -> None:
    """out [P, N] += LoRA delta, in place; z float32 [SPLIT_K, P, R_PAD] from moe_lora_shrink,
    lora_b [S, E, N, R] contiguous, slot_scales float32 [S], weights float32 [P] or None;
    block_diagonal: see the module docstring."""
    if blocks.block_m != config.block_m:
        raise ValueError(f"pair blocks of {blocks.block_m} rows, config wants {config.block_m}")
    _, num_experts, n_size, rank = lora_b.shape
    if out.shape != (blocks.num_pairs, n_size) or out.stride(1) != 1 or not lora_b.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} does not match LoRA B {tuple(lora_b.shape)} over {blocks.num_pairs}")
    if z.shape[1:] != (blocks.num_pairs, rank_pad(rank)) or not z.is_contiguous():
        raise ValueError(f"z {tuple(z.shape)} is not the shrink output for rank {rank}")
    columns = config.block_n * config.n_tiles  # one program's
    if block_diagonal and (rank % 2 or (n_size // 2) % columns):
        raise ValueError(f"block-diagonal B {tuple(lora_b.shape)} needs an even rank and programs within N/2")
    if blocks.num_pairs == 0:
        return
    grid = (blocks.max_blocks * triton.cdiv(n_size, columns),)
    _moe_expand_kernel[grid](
        z, lora_b, out, slot_scales, out if weights is None else weights, blocks.sorted_pairs, blocks.block_groups,
        blocks.num_pairs, blocks.max_blocks, num_experts, n_size, rank, z.shape[0],
        z.stride(0), z.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None, BLOCK_DIAGONAL=block_diagonal,
        R_PAD=rank_pad(rank // 2 if block_diagonal else rank), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        N_TILES=config.n_tiles, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
