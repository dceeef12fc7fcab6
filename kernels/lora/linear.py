"""Base projection with the LoRA expand in its epilogue: y = x · Wᵀ (+ bias) + LoRA, one GEMM launch.

Semantics (z from shrink.py, summed over its split axis; B_i[s] read through the page table, see
tiles.py):
    y[t, col_i : col_i + N_i] = x[t] @ W[col_i : col_i + N_i].T (+ bias)
                                + slot_scales[s] * z[i, t, :r] @ B_i[s, :, :r].T   where s = token_slots[t],
                                  r = slot_ranks[s], for tokens with s >= 0 and r > 0

Grid: output tiles of [BLOCK_M tokens (in batch order), BLOCK_N columns of one slice], swizzled in
groups of GROUP_M token tiles so that neighbouring programs share W tiles in L2. After the K loop,
a small tile (decode) gathers each row's own B rows (its page ids, then the rows) for a CUDA-core
product; a large one (prefill, where a tile holds one or two adapters) adds one tensor-core product
(BLOCK_M x R_PAD by R_PAD x BLOCK_N) per adapter present, after loading that adapter's page ids.
The delta never goes through memory and y is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora.configs import LinearConfig
from kernels.lora.metadata import LoRABatch
from kernels.lora.tiles import (
    SliceGroup,
    b_row_offsets,
    b_tile_offsets,
    check_batch,
    load_ranked,
    load_z,
    page_ids,
    rank_pad,
    select,
    select_ptr,
    slice_of,
)

GATHER_EPILOGUE_MAX_M = 32  # token tiles up to this many rows gather B per row


@triton.jit(do_not_specialize=["num_tokens", "z_stride_split", "z_stride_slice"])
def _linear_lora_kernel(
    x_ptr, w_ptr, bias_ptr, z_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
    token_slots_ptr, active_slots_ptr, num_active_ptr, slot_ranks_ptr, slot_scales_ptr, slot_pages_ptr,
    num_tokens, max_rank, k_size, n0, n1, n2, col0, col1, col2, tiles0, tiles1, total_tiles_n,
    split_k, x_stride, w_stride, y_stride, z_stride_split, z_stride_slice,
    PR: tl.constexpr, R_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATHER_EPILOGUE: tl.constexpr, R_CHUNK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(num_tokens, BLOCK_M)
    per_group = GROUP_M * total_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    slice_id, pid_n = slice_of((pid % per_group) // group_size, tiles0, tiles1)
    width = select(slice_id, n0, n1, n2)
    col = select(slice_id, col0, col1, col2)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width
    k_offs = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_stride + k_offs[None, :]
    # clamp rows/columns instead of masking them: the loads stay unmasked, the stores are masked
    w_rows = tl.where(n_ok, col + n, col)
    w_ptrs = w_ptr + w_rows[None, :].to(tl.int64) * w_stride + k_offs[:, None]
    token_slots = tl.load(token_slots_ptr + rows, mask=row_ok, other=-1)
    r = tl.arange(0, R_PAD)
    z_ptrs = z_ptr + slice_id * z_stride_slice + rows[:, None] * R_PAD + r[None, :]
    b_ptr = select_ptr(slice_id, b0_ptr, b1_ptr, b2_ptr)
    if GATHER_EPILOGUE:
        # small token tiles: each row gathers its own adapter's B rows after the K loop; its rank
        # and scale are loaded before it, so the epilogue costs two memory round trips (its page
        # ids, then z and B)
        slot = tl.maximum(token_slots, 0)
        rank = tl.load(slot_ranks_ptr + slot, mask=row_ok, other=0)
        rank = tl.where(token_slots >= 0, tl.minimum(rank, max_rank), 0)
        scale = tl.load(slot_scales_ptr + slot, mask=row_ok, other=0.0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_size, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k)
        else:
            k_ok = (k + k_offs) < k_size
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k, mask=k_ok[:, None], other=0.0)
        acc += tl.dot(x, w)

    if GATHER_EPILOGUE:
        z_rows = z_ptr + slice_id * z_stride_slice + rows[:, None] * R_PAD  # [M, 1]
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in tl.static_range(0, R_PAD, R_CHUNK):
            rc = r0 + tl.arange(0, R_CHUNK)
            page = page_ids(slot_pages_ptr, slot[:, None], rc[None, :], max_rank, PR)  # [M, R_CHUNK]
            z = load_z(z_rows + rc[None, :], (rank > 0)[:, None], split_k, z_stride_split, SPLIT_PAD)
            b_ptrs = b_ptr + b_row_offsets(page, rc, n, width, PR)  # [M, N, R_CHUNK]
            b = load_ranked(b_ptrs, rc[None, None, :], rank[:, None, None], max_rank, n_ok[None, :, None])
            delta += tl.sum(b.to(tl.float32) * z[:, None, :], axis=2)
        acc += delta * scale[:, None]
    else:
        # large token tiles: one rank-R product per adapter that owns a row of the tile
        for j in range(0, tl.load(num_active_ptr)):
            active = tl.load(active_slots_ptr + j)
            mine = token_slots == active
            if tl.max(mine.to(tl.int32), 0) > 0:
                active_rank = tl.minimum(tl.load(slot_ranks_ptr + active), max_rank)
                z = load_z(z_ptrs, mine[:, None], split_k, z_stride_split, SPLIT_PAD)
                z *= tl.load(slot_scales_ptr + active)
                page = page_ids(slot_pages_ptr, active, r, max_rank, PR)
                b_ptrs = b_ptr + b_tile_offsets(page, r, n, width, PR)
                b = load_ranked(b_ptrs, r[:, None], active_rank, max_rank, n_ok[None, :])
                acc += tl.dot(z.to(b.dtype), b)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * y_stride + col + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def linear_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    config: LinearConfig,
) -> torch.Tensor:
    """y [T, sum N_i] = x [T, K] · weight [sum N_i, K]ᵀ (+ bias) + the LoRA delta of z (float32
    [SPLIT_K, num_slices, T, R_PAD] from lora_shrink) through lora_b[i] [P, N_i, PR] (contiguous);
    x and weight with unit column stride. See the module docstring."""
    num_tokens, k_size = x.shape
    split_k, num_slices, _, r_pad = z.shape
    max_rank = check_batch(group, batch, num_tokens)
    width = sum(group.widths)
    if weight.shape != (width, k_size) or weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} must be [{width}, {k_size}] in {x.dtype}, unit column stride")
    if bias is not None and (bias.shape != (width,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{width}] tensor in {x.dtype}")
    if num_slices != group.num_slices or group.columns[0] != 0 or z.shape[2] != num_tokens:
        raise ValueError("z and the slices must cover the whole projection (at most 3 slices)")
    if z.dtype != torch.float32 or r_pad != rank_pad(max_rank) or not z.is_contiguous():
        raise ValueError(f"z {tuple(z.shape)} {z.dtype} does not come from lora_shrink for these weights")
    y = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    tiles = group.tiles(config.block_n)
    grid = (triton.cdiv(num_tokens, config.block_m) * sum(tiles),)
    _linear_lora_kernel[grid](
        x, weight, weight if bias is None else bias, z, *group.lora_b, y,
        batch.token_slots, batch.active_slots, batch.num_active, batch.slot_ranks, batch.slot_scales,
        batch.slot_pages,
        num_tokens, max_rank, k_size, *group.widths, *group.columns, tiles[0], tiles[1], sum(tiles),
        split_k, x.stride(0), weight.stride(0), y.stride(0), z.stride(0), z.stride(1),
        PR=group.page_rank, R_PAD=r_pad, SPLIT_PAD=triton.next_power_of_2(split_k),
        HAS_BIAS=bias is not None, EVEN_K=k_size % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        GATHER_EPILOGUE=config.block_m <= GATHER_EPILOGUE_MAX_M, R_CHUNK=16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y
