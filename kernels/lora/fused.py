"""Fused shrink + expand for decode-sized batches: z = x · Aᵀ stays in registers, one launch.

Semantics: exactly expand.py's (accumulate or bias-write), with z computed in the same program
(A_i[s] and B_i[s] read through the page table, see tiles.py):
    for each token t with s = token_slots[t] >= 0 and r = slot_ranks[s] > 0, for each slice i:
        delta = slot_scales[s] * (x[t] @ A_i[s, :r].T) @ B_i[s, :, :r].T
        accumulate: y[t, cols_i] += delta;   otherwise: y[t, cols_i] = bias[cols_i] + delta
    (otherwise, rows of tokens without LoRA are set to the bias, or 0)

Grid: (output chunks of all slices, token tiles). A program loads its slot's pages once, recomputes
its tile's z over the whole K (A_i[s] is max_rank x K, re-read from L2 by the other chunks of the
slot) and then walks n_chunk output columns. It pays one launch instead of two and never writes z
to memory, but every chunk re-reads A from L2 and redoes the K reduction: on the H200 it measured
slower than the other paths at every batch size tried (docs/benchmarks.md), so the tuned plans
there never pick it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora.configs import FusedConfig
from kernels.lora.expand import expand_chunk
from kernels.lora.metadata import LoRABatch, max_token_tiles
from kernels.lora.tiles import (
    SliceGroup,
    a_tile_offsets,
    b_tile_offsets,
    check_batch,
    page_ids,
    rank_pad,
    select,
    select_ptr,
    slice_of,
    token_tile,
)


@triton.jit
def _fused_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, bias_ptr,
    sorted_tokens_ptr, tile_map_ptr, slot_ranks_ptr, slot_scales_ptr, slot_pages_ptr,
    num_slots, max_rank, k_size, n0, n1, n2, col0, col1, col2, chunks0, chunks1, n_chunk,
    x_stride, y_stride,
    PR: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    num_groups = num_slots if ACCUMULATE else num_slots + 1
    group, row0, count, start = token_tile(tile_map_ptr, tl.program_id(1))
    if group >= num_groups:
        return
    slice_id, chunk = slice_of(tl.program_id(0), chunks0, chunks1)
    width = select(slice_id, n0, n1, n2)
    col = select(slice_id, col0, col1, col2)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    tokens = tl.load(sorted_tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    n_offs = tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + tokens[:, None] * y_stride + col + n_offs[None, :]
    bias_ptrs = bias_ptr + col + n_offs[None, :]
    n_first = chunk * n_chunk
    n_last = tl.minimum(n_first + n_chunk, width)
    r = tl.arange(0, R_PAD)
    if group == num_slots:
        zs = tl.zeros((BLOCK_M, R_PAD), dtype=y_ptr.dtype.element_ty)
        expand_chunk(zs, y_ptrs, y_ptrs, bias_ptrs, row_ok, r, 0, n_first, n_last, width, max_rank,
                     PR, BLOCK_N, False, False, HAS_BIAS)  # fmt: skip
        return

    rank = tl.minimum(tl.load(slot_ranks_ptr + group), max_rank)
    scale = tl.load(slot_scales_ptr + group)
    page = page_ids(slot_pages_ptr, group, r, max_rank, PR)
    r_ok = r < rank
    k_offs = tl.arange(0, BLOCK_K)
    a_ptr = select_ptr(slice_id, a0_ptr, a1_ptr, a2_ptr)
    a_ptrs = a_ptr + a_tile_offsets(page, r, k_offs, k_size, PR)
    x_ptrs = x_ptr + tokens[:, None] * x_stride + k_offs[None, :]
    z = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k in range(0, k_size, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
            a = tl.load(a_ptrs + k, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = (k + k_offs) < k_size
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptrs + k, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        z += tl.dot(x, a)

    b_ptr = select_ptr(slice_id, b0_ptr, b1_ptr, b2_ptr)
    b_ptrs = b_ptr + b_tile_offsets(page, r, n_offs, width, PR)
    zs = (z * scale).to(x_ptr.dtype.element_ty)
    expand_chunk(zs, b_ptrs, y_ptrs, bias_ptrs, row_ok, r, rank, n_first, n_last, width, max_rank,
                 PR, BLOCK_N, True, ACCUMULATE, HAS_BIAS)  # fmt: skip


def lora_fused(
    y: torch.Tensor,
    x: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    config: FusedConfig,
    bias: torch.Tensor | None = None,
    accumulate: bool = True,
) -> None:
    """Adds (or, with accumulate=False, writes bias +) the LoRA delta of x [T, K] (unit column stride)
    into y [T, sum N_i]; lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]. See the module docstring."""
    num_tokens, k_size = x.shape
    max_rank = check_batch(group, batch, num_tokens)
    num_slots = batch.num_slots
    if y.shape[0] != num_tokens or y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"y {tuple(y.shape)} {y.dtype} must be [T={num_tokens}, N] in {x.dtype}, unit column stride")
    if bias is not None and (accumulate or bias.dtype != y.dtype or not bias.is_contiguous()):
        raise ValueError("bias is only written without accumulate, contiguous and in y's dtype")
    if num_tokens == 0:
        return
    chunks = group.tiles(config.n_chunk)
    num_groups = num_slots if accumulate else num_slots + 1
    grid = (sum(chunks), max_token_tiles(num_tokens, num_groups, config.block_m))
    _fused_kernel[grid](
        x, *group.lora_a, *group.lora_b, y, y if bias is None else bias,
        batch.sorted_tokens, batch.token_tiles(config.block_m), batch.slot_ranks, batch.slot_scales, batch.slot_pages,
        num_slots, max_rank, k_size, *group.widths, *group.columns, chunks[0], chunks[1], config.n_chunk,
        x.stride(0), y.stride(0),
        PR=group.page_rank, R_PAD=rank_pad(max_rank),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k_size % config.block_k == 0, ACCUMULATE=accumulate, HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
