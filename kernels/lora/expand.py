"""Expand: y += scale · z · Bᵀ per token, all slices of a projection in one launch.

Semantics (z from shrink.py, summed over its split axis; B_i[s] [N_i, max_rank]: slot s's rank
columns of lora_b[i] [P, N_i, PR], through the page table slot_pages, see tiles.py):
    for each token t with s = token_slots[t] >= 0 and r = slot_ranks[s] > 0, for each slice i:
        delta = slot_scales[s] * z[i, t, :r] @ B_i[s, :, :r].T
        accumulate:   y[t, col_i : col_i + N_i] += delta
        otherwise:    y[t, col_i : col_i + N_i]  = bias[col_i : col_i + N_i] + delta
    without accumulate, every other token's row is set to the bias (or 0): y needs no prior fill,
    and the base GEMM then adds x · Wᵀ into it in its own epilogue (torch.addmm_, beta = 1).

Grid: (output chunks of n_chunk columns over all slices, token tiles). A program walks its chunk
BLOCK_N columns at a time, so its one-off latency (tile map, token ids, z) is paid once per chunk
rather than per tile, and the loads of later steps overlap earlier ones. Its slot's pages are
loaded once, beside its rank. A B tile is read by all token tiles of its slot: a slot's B is at
most N x max_rank (~1 MB), so those re-reads hit L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora.configs import ExpandConfig
from kernels.lora.metadata import LoRABatch, max_token_tiles
from kernels.lora.tiles import (
    SliceGroup,
    b_tile_offsets,
    check_batch,
    load_ranked,
    load_z,
    page_ids,
    rank_pad,
    select,
    select_ptr,
    slice_of,
    token_tile,
)


@triton.jit
def expand_chunk(
    zs, b_ptrs, y_ptrs, bias_ptrs, row_ok, r, rank, n_first, n_last, width, max_rank,
    PR: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LORA: tl.constexpr, ACCUMULATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Walk columns [n_first, n_last) BLOCK_N at a time: y = (bias +) zs · B (zs [M, R] already
    scaled, in B's dtype), or y += zs · B; without LoRA (the no-LoRA group) y = bias, or 0.
    b_ptrs: [R, BLOCK_N] at column 0 (tiles.b_tile_offsets: a column is PR apart in its page);
    y_ptrs, bias_ptrs: [M, BLOCK_N] / [1, BLOCK_N] at column 0.
    Every address depends only on the loop index, so the loads of later steps are issued early."""
    n_offs = tl.arange(0, BLOCK_N)
    for n in range(n_first, n_last, BLOCK_N):
        n_ok = (n + n_offs) < width
        mask = row_ok[:, None] & n_ok[None, :]
        if ACCUMULATE:
            acc = tl.load(y_ptrs + n, mask=mask, other=0.0).to(tl.float32)
        elif HAS_BIAS:
            acc = tl.zeros(mask.shape, tl.float32) + tl.load(bias_ptrs + n, mask=n_ok[None, :], other=0.0).to(
                tl.float32
            )
        else:
            acc = tl.zeros(mask.shape, tl.float32)
        if HAS_LORA:
            b = load_ranked(b_ptrs + n * PR, r[:, None], rank, max_rank, n_ok[None, :])
            acc += tl.dot(zs, b)
        tl.store(y_ptrs + n, acc.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["z_stride_split", "z_stride_slice"])
def _expand_kernel(
    z_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, bias_ptr,
    sorted_tokens_ptr, tile_map_ptr, slot_ranks_ptr, slot_scales_ptr, slot_pages_ptr,
    num_slots, max_rank, n0, n1, n2, col0, col1, col2, chunks0, chunks1, n_chunk,
    split_k, y_stride, z_stride_split, z_stride_slice,
    PR: tl.constexpr, R_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # accumulate: only the S slot groups; otherwise also the no-LoRA group S, whose rows get the bias
    num_groups = num_slots if ACCUMULATE else num_slots + 1
    group, row0, count, start = token_tile(tile_map_ptr, tl.program_id(1))
    if group >= num_groups:
        return
    slice_id, chunk = slice_of(tl.program_id(0), chunks0, chunks1)
    width = select(slice_id, n0, n1, n2)
    col = select(slice_id, col0, col1, col2)
    n_first = chunk * n_chunk
    n_last = tl.minimum(n_first + n_chunk, width)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    tokens = tl.load(sorted_tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    n_offs = tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + tokens[:, None] * y_stride + col + n_offs[None, :]
    bias_ptrs = bias_ptr + col + n_offs[None, :]
    r = tl.arange(0, R_PAD)
    if group == num_slots:
        zs = tl.zeros((BLOCK_M, R_PAD), dtype=y_ptr.dtype.element_ty)
        expand_chunk(zs, y_ptrs, y_ptrs, bias_ptrs, row_ok, r, 0, n_first, n_last, width, max_rank,
                     PR, BLOCK_N, False, False, HAS_BIAS)  # fmt: skip
        return

    rank = tl.minimum(tl.load(slot_ranks_ptr + group), max_rank)
    scale = tl.load(slot_scales_ptr + group)
    page = page_ids(slot_pages_ptr, group, r, max_rank, PR)
    z_ptrs = z_ptr + slice_id * z_stride_slice + tokens[:, None] * R_PAD + r[None, :]
    z = load_z(z_ptrs, row_ok[:, None], split_k, z_stride_split, SPLIT_PAD)
    b_ptr = select_ptr(slice_id, b0_ptr, b1_ptr, b2_ptr)
    b_ptrs = b_ptr + b_tile_offsets(page, r, n_offs, width, PR)
    zs = (z * scale).to(b_ptr.dtype.element_ty)
    expand_chunk(zs, b_ptrs, y_ptrs, bias_ptrs, row_ok, r, rank, n_first, n_last, width, max_rank,
                 PR, BLOCK_N, True, ACCUMULATE, HAS_BIAS)  # fmt: skip


def check_expand_args(
    y: torch.Tensor,
    z: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    bias: torch.Tensor | None,
    accumulate: bool,
) -> tuple[int, int, int, int]:
    """Check an expand launch's tensors against each other; returns (T, SPLIT_K, R_PAD, max rank).
    y: [T, sum N_i] (this group's slices at group.columns), unit column stride; z: float32
    [SPLIT_K, num_slices, T, R_PAD] from lora_shrink; lora_b[i]: [P, N_i, PR] contiguous."""
    num_tokens = y.shape[0]
    split_k, num_slices, _, r_pad = z.shape
    max_rank = check_batch(group, batch, num_tokens)
    if y.stride(1) != 1 or y.dtype != group.lora_b[0].dtype:
        raise ValueError(f"y must have unit column stride and dtype {group.lora_b[0].dtype}")
    if z.dtype != torch.float32 or z.shape[2] != num_tokens or r_pad != rank_pad(max_rank) or not z.is_contiguous():
        raise ValueError(f"z {tuple(z.shape)} {z.dtype} does not come from lora_shrink for these weights")
    if num_slices != group.num_slices:
        raise ValueError("z and y disagree on slices")
    if bias is not None and (accumulate or bias.dtype != y.dtype or not bias.is_contiguous()):
        raise ValueError("bias is only written without accumulate, contiguous and in y's dtype")
    return num_tokens, split_k, r_pad, max_rank


def lora_expand(
    y: torch.Tensor,
    z: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    config: ExpandConfig,
    bias: torch.Tensor | None = None,
    accumulate: bool = True,
) -> None:
    """Adds (or, with accumulate=False, writes bias +) the LoRA delta of z into y; see the module docstring."""
    num_tokens, split_k, r_pad, max_rank = check_expand_args(y, z, group, batch, bias, accumulate)
    num_slots = batch.num_slots
    if num_tokens == 0:
        return
    chunks = group.tiles(config.n_chunk)
    num_groups = num_slots if accumulate else num_slots + 1
    grid = (sum(chunks), max_token_tiles(num_tokens, num_groups, config.block_m))
    _expand_kernel[grid](
        z, *group.lora_b, y, y if bias is None else bias,
        batch.sorted_tokens, batch.token_tiles(config.block_m), batch.slot_ranks, batch.slot_scales, batch.slot_pages,
        num_slots, max_rank, *group.widths, *group.columns, chunks[0], chunks[1], config.n_chunk,
        split_k, y.stride(0), z.stride(0), z.stride(1),
        PR=group.page_rank, R_PAD=r_pad,
        SPLIT_PAD=triton.next_power_of_2(split_k),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        ACCUMULATE=accumulate, HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
