"""Shrink: z = x · Aᵀ for every token with an adapter, all slices of a projection in one launch.

Semantics (A_i[s] [max_rank, K]: slot s's rank rows of lora_a[i] [P, PR, K], through the page
table slot_pages, see tiles.py):
    for each token t with s = token_slots[t] >= 0 and r = slot_ranks[s] > 0, for each slice i:
        z[:, i, t, :r] summed over the split axis == x[t] @ A_i[s, :r].T      (fp32, unscaled)
        z[:, i, t, r:] == 0, so readers mask z by token only (whole rows load as vectors)
    rows of other tokens are never written (and never read).

Grid: (SPLIT_K, token tiles). Each program owns one tile of one slot's tokens and one K range and
computes all slices from a single load of its x tile (its slot's pages are loaded once, before the
K loop, and serve every slice); the K reduction is split so that decode-sized
batches still spread the reads of A over the whole GPU. Partial sums stay separate (no atomics, no
zero-fill launch): expand adds the SPLIT_K partials when it loads z. A slot's A chunks are read by
all of its token tiles; tiles of one slot are adjacent in launch order, so the re-reads hit L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora.configs import ShrinkConfig
from kernels.lora.metadata import LoRABatch, max_token_tiles
from kernels.lora.tiles import SliceGroup, a_tile_offsets, check_batch, page_ids, rank_pad, token_tile


@triton.jit(do_not_specialize=["z_stride_split", "z_stride_slice"])
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, z_ptr,
    sorted_tokens_ptr, tile_map_ptr, slot_ranks_ptr, slot_pages_ptr,
    num_slots, max_rank, k_size, split_k,
    x_stride, z_stride_split, z_stride_slice,
    NUM_SLICES: tl.constexpr, PR: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    slot, row0, count, start = token_tile(tile_map_ptr, tl.program_id(1))
    if slot >= num_slots:
        return
    pid_k = tl.program_id(0)
    rank = tl.minimum(tl.load(slot_ranks_ptr + slot), max_rank)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    tokens = tl.load(sorted_tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    r = tl.arange(0, R_PAD)
    r_ok = r < rank
    k_offs = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * x_stride + k_offs[None, :]  # [BLOCK_M, BLOCK_K]
    page = page_ids(slot_pages_ptr, slot, r, max_rank, PR)
    a_offs = a_tile_offsets(page, r, k_offs, k_size, PR)  # [BLOCK_K, R_PAD]
    acc0 = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    k_per_split = tl.cdiv(k_size, split_k * BLOCK_K) * BLOCK_K
    for k in range(pid_k * k_per_split, (pid_k + 1) * k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
            a_mask = r_ok[None, :]
        else:
            k_ok = (k + k_offs) < k_size
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_mask = r_ok[None, :] & k_ok[:, None]
        acc0 += tl.dot(x, tl.load(a0_ptr + a_offs + k, mask=a_mask, other=0.0))
        if NUM_SLICES > 1:
            acc1 += tl.dot(x, tl.load(a1_ptr + a_offs + k, mask=a_mask, other=0.0))
        if NUM_SLICES > 2:
            acc2 += tl.dot(x, tl.load(a2_ptr + a_offs + k, mask=a_mask, other=0.0))

    z_ptrs = z_ptr + pid_k * z_stride_split + tokens[:, None] * R_PAD + r[None, :]
    tl.store(z_ptrs, acc0, mask=row_ok[:, None])
    if NUM_SLICES > 1:
        tl.store(z_ptrs + z_stride_slice, acc1, mask=row_ok[:, None])
    if NUM_SLICES > 2:
        tl.store(z_ptrs + 2 * z_stride_slice, acc2, mask=row_ok[:, None])


def lora_shrink(x: torch.Tensor, group: SliceGroup, batch: LoRABatch, config: ShrinkConfig) -> torch.Tensor:
    """z: float32 [SPLIT_K, num_slices, T, R_PAD] (partial sums; see the module docstring) for x [T, K]
    (unit column stride) and the group's lora_a[i] [P, PR, K] (contiguous), R_PAD = rank_pad(max_rank)."""
    num_tokens, k_size = x.shape
    max_rank = check_batch(group, batch, num_tokens)
    num_slots = batch.num_slots
    r_pad = rank_pad(max_rank)
    z = torch.empty((config.split_k, group.num_slices, num_tokens, r_pad), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_slots == 0:
        return z
    grid = (config.split_k, max_token_tiles(num_tokens, num_slots, config.block_m))
    _shrink_kernel[grid](
        x, *group.lora_a, z,
        batch.sorted_tokens, batch.token_tiles(config.block_m), batch.slot_ranks, batch.slot_pages,
        num_slots, max_rank, k_size, config.split_k,
        x.stride(0), z.stride(0), z.stride(1),
        NUM_SLICES=group.num_slices, PR=group.page_rank, R_PAD=r_pad,
        BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        EVEN_K=k_size % (config.block_k * config.split_k) == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return z
