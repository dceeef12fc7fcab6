"""Pieces shared by the LoRA kernels: the token-tile map and the stacked-slice bookkeeping.

Token tiles: a launch covers `max_token_tiles(T, G, BLOCK_M)` programs along its token axis; program
p finds the group g (metadata.py) and the tile of that group's tokens it owns from the per-group
token counts alone (a prefix sum over at most S + 1 entries), so no per-step host work or per-block
size map is needed, and programs past the last tile exit at once. The token axis is the grid's
slow axis (y): the GPU dispatches blocks x-fastest, so the programs that have work run first and
the empty ones (the bound is loose) trail behind.

Slices: one launch serves up to MAX_SLICES stacked outputs (q|k|v, gate|up), each with its own A
and B tensor and width; programs along the output axis are laid out slice after slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SLICES = 3


def max_token_tiles(num_tokens: int, num_groups: int, block_m: int) -> int:
    """Upper bound of sum over groups of cdiv(count_g, BLOCK_M), knowing only T and the group count."""
    return triton.cdiv(num_tokens, block_m) + min(num_groups, num_tokens)


@triton.jit
def group_tile(pid_m, group_counts_ptr, NUM_GROUPS, GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(group, first row of this program's tile in the group, the group's token count, its first
    index into sorted_tokens); group >= NUM_GROUPS: no tile. One load: the rest is a prefix sum."""
    g = tl.arange(0, GROUPS_PAD)
    counts = tl.load(group_counts_ptr + g, mask=g < NUM_GROUPS, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    group = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
    mine = g == group
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    start = tl.sum(tl.where(mine, tl.cumsum(counts, 0) - counts, 0), 0)
    return group, (pid_m - first_tile) * BLOCK_M, count, start


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

    lora_a: tuple[torch.Tensor, ...]  # MAX_SLICES x [S, R, K]
    lora_b: tuple[torch.Tensor, ...]  # MAX_SLICES x [S, N_i, R]
    widths: tuple[int, ...]  # MAX_SLICES x N_i, 0 for padding
    columns: tuple[int, ...]  # MAX_SLICES x first output column of the slice
    num_slices: int

    def tiles(self, block: int) -> tuple[int, ...]:
        """Programs per slice along N when each covers `block` columns."""
        return tuple(triton.cdiv(n, block) for n in self.widths)


def check_slices(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], num_slots: int
) -> tuple[int, int]:
    """Validate the stacked LoRA weights against x [T, K]; returns (max_rank, total output width)."""
    if len(lora_a) == 0 or len(lora_a) != len(lora_b):
        raise ValueError(f"need one lora_a and one lora_b per slice, got {len(lora_a)} and {len(lora_b)}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit column stride, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported (float16, bfloat16, float32)")
    num_slots_a, max_rank, k = lora_a[0].shape
    for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
        if a.dtype != x.dtype or b.dtype != x.dtype:
            raise ValueError(f"slice {i}: lora weights are {a.dtype}/{b.dtype}, x is {x.dtype}")
        if a.device != x.device or b.device != x.device:
            raise ValueError(f"slice {i}: lora weights are not on {x.device}")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"slice {i}: lora_a and lora_b must be contiguous")
        if a.shape != (num_slots_a, max_rank, k) or a.shape[2] != x.shape[1]:
            raise ValueError(f"slice {i}: lora_a {tuple(a.shape)} must be [S, R, K={x.shape[1]}] like slice 0")
        if b.dim() != 3 or b.shape[0] != num_slots_a or b.shape[2] != max_rank:
            raise ValueError(f"slice {i}: lora_b {tuple(b.shape)} must be [S={num_slots_a}, N_i, R={max_rank}]")
    if num_slots_a != num_slots:
        raise ValueError(f"lora weights hold {num_slots_a} slots, the batch metadata {num_slots}")
    return max_rank, sum(b.shape[1] for b in lora_b)


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
