"""Expand for decode-sized batches: every token gathers its own adapter's B rows (no grouping).

Semantics: exactly expand.py's (z from shrink.py, accumulate or bias-write; B_i[s] read through
the page table, see tiles.py):
    for each token t with s = token_slots[t] >= 0 and r = slot_ranks[s] > 0, for each slice i:
        delta = slot_scales[s] * z[i, t, :r] @ B_i[s, :, :r].T
        accumulate: y[t, cols_i] += delta;   otherwise: y[t, cols_i] = bias[cols_i] + delta
    (otherwise, rows of tokens without LoRA are set to the bias, or 0)

Grid: (output tiles of all slices, blocks of BLOCK_T positions of the slot-sorted token order).
No program is empty (accumulating, the blocks past the adapter tokens return after one load), and
a program waits on two memory round trips (the token, rank, scale and page table row at its
positions, the last from LoRABatch.sorted_pages; then y, z and the B rows they address) rather
than expand.py's three (its row of the tile map, its token ids, then z and B). The product is a
broadcast multiply-add on the CUDA cores ([BLOCK_T, BLOCK_N, R_CHUNK] per step): cheap while T is
small, which is where this kernel is used. Sorted positions put the tokens of one adapter in the
same program, so repeated B rows come from L1 rather than L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora.configs import GatherConfig
from kernels.lora.expand import check_expand_args
from kernels.lora.metadata import LoRABatch
from kernels.lora.tiles import SliceGroup, b_row_offsets, load_ranked, load_z, page_ids, select, select_ptr, slice_of


@triton.jit(do_not_specialize=["num_tokens", "z_stride_split", "z_stride_slice"])
def _expand_gather_kernel(
    z_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, bias_ptr,
    sorted_tokens_ptr, sorted_ranks_ptr, sorted_scales_ptr, sorted_pages_ptr,
    num_tokens, max_rank, n0, n1, n2, col0, col1, col2, tiles0, tiles1,
    split_k, y_stride, z_stride_split, z_stride_slice,
    PR: tl.constexpr, R_PAD: tl.constexpr, R_CHUNK: tl.constexpr, SPLIT_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    pos_ok = pos < num_tokens
    if ACCUMULATE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # positions past the adapter tokens have nothing to add, and they come last
        if tl.load(sorted_ranks_ptr + tl.program_id(1) * BLOCK_T) == 0:
            return
    slice_id, pid_n = slice_of(tl.program_id(0), tiles0, tiles1)
    width = select(slice_id, n0, n1, n2)
    col = select(slice_id, col0, col1, col2)
    # round trip 1: which token, rank, scale and pages (page_ids below, per rank chunk; addressed
    # by the position alone) sit at each sorted position
    token = tl.load(sorted_tokens_ptr + pos, mask=pos_ok, other=0).to(tl.int64)
    pages_row = tl.where(pos_ok, pos, 0)[:, None]
    rank = tl.minimum(tl.load(sorted_ranks_ptr + pos, mask=pos_ok, other=0), max_rank)  # 0: no LoRA
    scale = tl.load(sorted_scales_ptr + pos, mask=pos_ok, other=0.0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width

    # round trip 2: y (accumulating), z and the B rows, all addressed by round trip 1 alone
    y_ptrs = y_ptr + token[:, None] * y_stride + col + n[None, :]
    if ACCUMULATE:
        mask = (pos_ok & (rank > 0))[:, None] & n_ok[None, :]
        acc = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = pos_ok[:, None] & n_ok[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + col + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    b_ptr = select_ptr(slice_id, b0_ptr, b1_ptr, b2_ptr)
    z_rows = z_ptr + slice_id * z_stride_slice + token[:, None] * R_PAD  # [T, 1]
    delta = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in tl.static_range(0, R_PAD, R_CHUNK):
        r = r0 + tl.arange(0, R_CHUNK)
        page = page_ids(sorted_pages_ptr, pages_row, r[None, :], max_rank, PR)  # [T, R_CHUNK]
        z = load_z(z_rows + r[None, :], (rank > 0)[:, None], split_k, z_stride_split, SPLIT_PAD)
        b_ptrs = b_ptr + b_row_offsets(page, r, n, width, PR)  # [T, N, R_CHUNK]
        b = load_ranked(b_ptrs, r[None, None, :], rank[:, None, None], max_rank, n_ok[None, :, None])
        delta += tl.sum(b.to(tl.float32) * z[:, None, :], axis=2)
    acc += delta * scale[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_gather(
    y: torch.Tensor,
    z: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    config: GatherConfig,
    bias: torch.Tensor | None = None,
    accumulate: bool = True,
) -> None:
    """Same contract as expand.lora_expand; see the module docstring for when it is the faster one."""
    num_tokens, split_k, r_pad, max_rank = check_expand_args(y, z, group, batch, bias, accumulate)
    if num_tokens == 0:
        return
    tiles = group.tiles(config.block_n)
    grid = (sum(tiles), triton.cdiv(num_tokens, config.block_t))
    _expand_gather_kernel[grid](
        z, *group.lora_b, y, y if bias is None else bias,
        batch.sorted_tokens, batch.sorted_ranks, batch.sorted_scales, batch.sorted_pages,
        num_tokens, max_rank, *group.widths, *group.columns, tiles[0], tiles[1],
        split_k, y.stride(0), z.stride(0), z.stride(1),
        PR=group.page_rank, R_PAD=r_pad, R_CHUNK=min(config.r_chunk, r_pad), SPLIT_PAD=triton.next_power_of_2(split_k),
        BLOCK_T=config.block_t, BLOCK_N=config.block_n, ACCUMULATE=accumulate, HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
