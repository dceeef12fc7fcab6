"""Pieces shared by the LoRA kernels: the token-tile map, the page table and the stacked-slice bookkeeping.

Token tiles: a launch over G groups (metadata.py; G = S for the shrink and the accumulating expands,
S + 1 with the no-LoRA group) covers `max_token_tiles(T, G, BLOCK_M)` programs along its token axis.
Groups are cut into tiles of BLOCK_M rows, in group order, and program p reads its tile from row p
of LoRABatch.token_tiles(BLOCK_M) (`token_tile`): one 16-byte load addressed by the program index
alone, built once per step, so a program starts loading its token ids one memory round trip after it
starts. A program whose group is G or more (the no-LoRA group's tiles, or the empty rows past the
last tile: the bound is loose) exits at once. The token axis is the grid's slow axis (y): the GPU
dispatches blocks x-fastest, so the programs that have work run first and the empty ones trail behind.

Slices: one launch serves up to MAX_SLICES stacked outputs (q|k|v, gate|up), each with its own A
and B tensor and width; programs along the output axis are laid out slice after slice.

Pages (S-LoRA's unified paging): slice i's weights are stored as pages of PR rank rows,
lora_a[i] [P, PR, K] and lora_b[i] [P, N_i, PR], and LoRABatch.slot_pages [S, pages_per_slot] says
which pages hold each slot's rank rows, in rank order, so that for rank index r < max_rank =
pages_per_slot * PR of slot s

    A_i[s][r, k] = lora_a[i][slot_pages[s, r // PR], r % PR, k]
    B_i[s][n, r] = lora_b[i][slot_pages[s, r // PR], n, r % PR]

A program loads the page of each rank index of its tile once (`page_ids`, an [R_PAD]-wide gather
of at most R_PAD / PR distinct entries) and addresses A and B through it. An A tile stays
contiguous along K. B is contiguous along the rank axis only within a page, in runs of PR, which
a gathered page id can hide from Triton's axis analysis (Triton 3.6 and 3.9 still infer it from the
page-id load's runs of one address: their PTX has the same 16-byte B loads with and without the
hints); `b_tile_offsets` and `b_row_offsets` state it with hints when PR % 16 == 0 (production
pages are 16 ranks: tl.dot's minimum and load_ranked's vector granularity), for compilers that do
not. The unpaged layout is PR = max_rank, one page per slot, slot_pages[s] = [s].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora.metadata import LoRABatch

MAX_SLICES = 3


@triton.jit
def token_tile(tile_map_ptr, pid_m):
    """(group, first row of the tile in the group, the group's token count, its first index into
    sorted_tokens) of program pid_m, from its row of a tile map (LoRABatch.token_tiles, 16-byte
    aligned rows): one 16-byte vector load, split in registers (no shuffles or shared memory)."""
    offs = tl.max_contiguous(tl.multiple_of(pid_m * 4 + tl.arange(0, 4), 4), 4)
    row = tl.reshape(tl.load(tile_map_ptr + offs), (2, 2))
    even, odd = tl.split(row)  # split takes the last axis: fields 0 and 2, fields 1 and 3
    group, count = tl.split(even)
    row0, start = tl.split(odd)
    return group, row0, count, start


@triton.jit
def load_z(z_ptrs, mask, split_k, z_stride_split, SPLIT_PAD: tl.constexpr):
    """Sum of shrink's split-K partials of z at z_ptrs ([M, R] pointers into split 0): one
    [SPLIT_PAD, M, R] load, so the partials cost one memory round trip, not split_k."""
    split = tl.arange(0, SPLIT_PAD)[:, None, None]
    ptrs = z_ptrs[None, :, :] + split * z_stride_split
    return tl.sum(tl.load(ptrs, mask=(split < split_k) & mask[None, :, :], other=0.0), axis=0)


@triton.jit
def load_ranked(ptrs, r, rank, max_rank, mask):
    """Load entries at rank index r < rank (r runs along the contiguous axis; mask covers the others).
    The load mask stops at a multiple of 16 so Triton keeps 16-byte vector loads (a per-entry rank
    mask would split them into 2-byte ones); the entries past the rank are zeroed afterwards."""
    vector_rank = tl.minimum((rank + 15) // 16 * 16, max_rank)
    return tl.where(r < rank, tl.load(ptrs, mask=mask & (r < vector_rank), other=0.0), 0.0)


@triton.jit
def page_ids(table_ptr, row, r, max_rank, PR: tl.constexpr):
    """int64 page holding each rank index r (< max_rank; 0 past it) of page table row `row` (a slot of
    LoRABatch.slot_pages, or a position of sorted_pages: both have max_rank // PR columns). Shapes
    broadcast: a scalar row and r [R] give [R]; rows [M, 1] and r [1, R] give [M, R]."""
    ptrs = table_ptr + row * (max_rank // PR) + r // PR
    return tl.load(ptrs, mask=r < max_rank, other=0).to(tl.int64)


@triton.jit
def a_tile_offsets(page, r, k_offs, k_size, PR: tl.constexpr):
    """Offsets [BLOCK_K, R] into a slice's A [P, PR, K] of rank indices r [R] (in pages page [R],
    from page_ids) at columns k_offs [BLOCK_K]: contiguous along K, as Triton sees unaided."""
    return page[None, :] * PR * k_size + (r % PR)[None, :] * k_size + k_offs[:, None]


@triton.jit
def b_tile_offsets(page, r, n, width, PR: tl.constexpr):
    """Offsets [R, N] into a slice's B [P, width, PR] of rank indices r [R] (in pages page [R]) at
    columns n [N]. Along r, runs of PR are contiguous and start at a multiple of PR: for PR % 16 == 0
    the hints say so (per axis: rank, column), so loads of B stay 16-byte vectors."""
    offs = page[:, None] * width * PR + n[None, :] * PR + (r % PR)[:, None]
    if PR % 16 == 0:
        offs = tl.max_contiguous(tl.multiple_of(offs, [16, 1]), [16, 1])
    return offs


@triton.jit
def b_row_offsets(page, r, n, width, PR: tl.constexpr):
    """Offsets [M, N, R] into a slice's B [P, width, PR] for rows that each gather their own
    adapter: rank indices r [R] in pages page [M, R], columns n [N]. Hinted like b_tile_offsets
    (per axis: row, column, rank) when PR and R are multiples of 16."""
    offs = page[:, None, :] * width * PR + n[None, :, None] * PR + (r % PR)[None, None, :]
    if PR % 16 == 0 and r.shape[0] % 16 == 0:
        offs = tl.max_contiguous(tl.multiple_of(offs, [1, 1, 16]), [1, 1, 16])
    return offs


@triton.jit
def slice_of(pid_n, tiles0, tiles1):
    """(slice, program index inside it) for programs laid out slice after slice."""
    slice_id = (pid_n >= tiles0).to(tl.int32) + (pid_n >= tiles0 + tiles1).to(tl.int32)
    return slice_id, pid_n - select(slice_id, 0, tiles0, tiles0 + tiles1)


@triton.jit
def select(slice_id, v0, v1, v2):
    """v0, v1 or v2 by slice, for integers (a select keeps the divisibility Triton knows of each)."""
    return tl.where(slice_id == 0, v0, tl.where(slice_id == 1, v1, v2))


@triton.jit
def select_ptr(slice_id, p0, p1, p2):
    """p0, p1 or p2 by slice, for pointers of one type."""
    if slice_id == 0:
        p = p0
    elif slice_id == 1:
        p = p1
    else:
        p = p2
    return p


@dataclass(frozen=True, slots=True)
class SliceGroup:
    """Up to MAX_SLICES consecutive slices, padded by repeating the last so every kernel argument exists."""

    lora_a: tuple[torch.Tensor, ...]  # MAX_SLICES x [P, PR, K]
    lora_b: tuple[torch.Tensor, ...]  # MAX_SLICES x [P, N_i, PR]
    widths: tuple[int, ...]  # MAX_SLICES x N_i, 0 for padding
    columns: tuple[int, ...]  # MAX_SLICES x first output column of the slice
    num_slices: int

    def tiles(self, block: int) -> tuple[int, ...]:
        """Programs per slice along N when each covers `block` columns."""
        return tuple(triton.cdiv(n, block) for n in self.widths)

    @property
    def page_rank(self) -> int:
        """PR: rank rows per page."""
        return self.lora_a[0].shape[1]


def check_batch(group: SliceGroup, batch: LoRABatch, num_tokens: int) -> int:
    """Check a launch's batch metadata against its T tokens; returns the slots' max rank,
    pages_per_slot * PR (the weights themselves are checked by check_slices)."""
    if batch.num_tokens != num_tokens:
        raise ValueError(f"batch metadata is for T={batch.num_tokens}, the launch for T={num_tokens}")
    return batch.pages_per_slot * group.page_rank


def check_slices(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], batch: LoRABatch
) -> tuple[int, int]:
    """Validate the paged LoRA weights (lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]) against x [T, K]
    and the batch's page table (slot_pages [S, pages_per_slot]); returns (max rank = pages_per_slot *
    PR, total output width). Page ids themselves are not checked: that would wait on the GPU."""
    if len(lora_a) == 0 or len(lora_a) != len(lora_b):
        raise ValueError(f"need one lora_a and one lora_b per slice, got {len(lora_a)} and {len(lora_b)}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit column stride, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported (float16, bfloat16, float32)")
    if lora_a[0].dim() != 3:
        raise ValueError(f"lora_a {tuple(lora_a[0].shape)} must be [P, PR, K]")
    num_pages, page_rank, k = lora_a[0].shape
    for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
        if a.dtype != x.dtype or b.dtype != x.dtype:
            raise ValueError(f"slice {i}: lora weights are {a.dtype}/{b.dtype}, x is {x.dtype}")
        if a.device != x.device or b.device != x.device:
            raise ValueError(f"slice {i}: lora weights are not on {x.device}")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"slice {i}: lora_a and lora_b must be contiguous")
        if a.shape != (num_pages, page_rank, k) or k != x.shape[1]:
            raise ValueError(f"slice {i}: lora_a {tuple(a.shape)} must be [P, PR, K={x.shape[1]}] like slice 0")
        if b.dim() != 3 or b.shape[0] != num_pages or b.shape[2] != page_rank:
            raise ValueError(f"slice {i}: lora_b {tuple(b.shape)} must be [P={num_pages}, N_i, PR={page_rank}]")
    if page_rank == 0:
        raise ValueError("pages must hold at least one rank row (PR > 0)")
    if batch.slot_pages.device != x.device:
        raise ValueError(f"the batch's page table is on {batch.slot_pages.device}, x on {x.device}")
    return batch.pages_per_slot * page_rank, sum(b.shape[1] for b in lora_b)


def slice_groups(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]) -> list[SliceGroup]:
    """Split the slices into launches of at most MAX_SLICES (Llama's q|k|v and gate|up fit one)."""
    groups = []
    column = 0
    for first in range(0, len(lora_a), MAX_SLICES):
        a = tuple(lora_a[first : first + MAX_SLICES])
        b = tuple(lora_b[first : first + MAX_SLICES])
        widths = [t.shape[1] for t in b]
        columns = [column + sum(widths[:i]) for i in range(len(widths))]
        column += sum(widths)
        pad = MAX_SLICES - len(a)
        groups.append(
            SliceGroup(
                lora_a=a + (a[-1],) * pad,
                lora_b=b + (b[-1],) * pad,
                widths=tuple(widths) + (0,) * pad,
                columns=tuple(columns) + (columns[-1],) * pad,
                num_slices=len(a),
            )
        )
    return groups


def rank_pad(max_rank: int) -> int:
    """Rank dimension of the kernels' tiles: a power of two, at least tl.dot's minimum of 16."""
    return max(16, triton.next_power_of_2(max_rank))
