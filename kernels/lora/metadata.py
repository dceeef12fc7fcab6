"""Per-step LoRA metadata, built once per engine step and shared by every layer's LoRA call.

Tokens are grouped by adapter slot so a kernel tile never mixes adapters: group g < S holds the
tokens of slot g (empty when the slot's rank is 0), group S ("no LoRA") holds base-model tokens and
tokens of rank-0 slots. Everything here is computed with device ops of fixed output size, so
building it never waits on the GPU and can be captured in a CUDA graph. On CUDA, batches of up to
MAX_KERNEL_TOKENS tokens are built by one Triton launch in place of about twenty small torch ops
(docs/benchmarks.md, "Engine"): one program sorts (group, token) keys in registers, and beside it
one program per tile height writes that height's tile map. Larger batches, and CPU tensors, take
the torch ops, which are also the kernel's oracle.

Adapter weights live in pages of PR rank rows (S-LoRA's unified paging, see tiles.py): slot_pages
is the page table, row s listing the pages of slot s in rank order, so rank index r of slot s is
row r % PR of page slot_pages[s, r // PR]. A slot holds at most max_rank = pages_per_slot * PR.

    token_slots    = [ 2, -1,  0,  2]          (S = 3, all ranks > 0)
    sorted_tokens  = [ 2,  0,  3,  1]          tokens ordered by group, stable
    group_counts   = [ 1,  0,  2,  1]          [S + 1]; a group's tokens start at the sum of the counts before it
    active_slots   = [ 0,  2, -1]              [S], slots with tokens, ascending, then -1
    num_active     = [ 2]
    sorted_ranks   = [16, 16, 16,  0]          rank at each sorted position, 0 without LoRA; with
                                               sorted_slots, sorted_scales and sorted_pages (the page
                                               table row of each position), what decode kernels read
    tile_map[0]    = [[ 0, 0, 1, 0],           [len(TILE_HEIGHTS), P, 4]: for tiles of TILE_HEIGHTS[h]
                      [ 2, 0, 2, 1],           rows (here h = 0: 16), program p's (group, first row
                      [ 3, 0, 1, 3],           of its tile in the group, the group's count, its start
                      [ 4, 0, 0, 0],           in sorted_tokens); P = max_token_tiles(T, S + 1, 16)
                      [ 4, 0, 0, 0]]           rows, those past the last tile empty

The tile map is what the grouped kernels (tiles.py) read to find their tile: one 16-byte row per
program, addressed by its program index alone, where a prefix sum over group_counts would cost
every program of every launch a chain of loads and reductions. Groups' tiles are in group order, so
the no-LoRA group's come last and a launch over the S slot groups alone (the shrink, accumulating
expands) reads a prefix of the same map: a program whose group is past its launch's groups exits.
Rows past the last tile are empty: group S + 1, and zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

MAX_KERNEL_TOKENS = 4096  # one program sorts every token's key in registers
# BLOCK_M of the grouped kernels' token tiles, one tile map each, doubling (the build kernel's
# program 1 + h writes the map of TILE_HEIGHTS[0] << h)
TILE_HEIGHTS = (16, 32, 64, 128)


def max_token_tiles(num_tokens: int, num_groups: int, block_m: int) -> int:
    """Upper bound of sum over groups of cdiv(count_g, BLOCK_M), knowing only T and the group count:
    the grouped kernels' grid along the token axis, and the tile map's rows (at the smallest height)."""
    return triton.cdiv(num_tokens, block_m) + min(num_groups, num_tokens)


@triton.jit(do_not_specialize=["num_tokens", "map_rows"])
def _build_kernel(
    token_slots_ptr, slot_ranks_ptr, slot_scales_ptr, slot_pages_ptr,
    sorted_tokens_ptr, group_counts_ptr, active_slots_ptr, num_active_ptr,
    sorted_slots_ptr, sorted_ranks_ptr, sorted_scales_ptr, sorted_pages_ptr, tile_map_ptr,
    num_tokens, num_slots, pages_per_slot, map_rows,
    BLOCK_T: tl.constexpr, BINS: tl.constexpr, PAGES_PAD: tl.constexpr, ROWS_PAD: tl.constexpr,
    MIN_HEIGHT: tl.constexpr,
):  # fmt: skip
    """Program 0 sorts the tokens and writes every field but the tile map; program 1 + h, beside it,
    writes the tile map of MIN_HEIGHT << h rows from its own count of the groups."""
    t = tl.arange(0, BLOCK_T)
    valid = t < num_tokens
    slot = tl.load(token_slots_ptr + t, mask=valid, other=-1)
    rank = tl.load(slot_ranks_ptr + tl.maximum(slot, 0), mask=valid & (slot >= 0), other=0)
    # group S: no LoRA; S + 1: the padding past num_tokens, sorted after everything
    group = tl.where((slot >= 0) & (rank > 0), slot, num_slots)
    group = tl.where(valid, group, num_slots + 1)
    counts = tl.histogram(group, BINS)  # [BINS]; bins past S + 1 stay 0
    bins = tl.arange(0, BINS)
    pid = tl.program_id(0)
    if pid > 0:
        h = pid - 1
        _write_tile_map(tile_map_ptr + h * map_rows * 4, tl.where(bins <= num_slots, counts, 0), num_slots, map_rows,
                       MIN_HEIGHT << h, ROWS_PAD)  # fmt: skip
        return

    # (group, token) keys are unique, so sorting them is a stable sort of the groups
    keys = tl.sort(group * BLOCK_T + t)
    order = keys % BLOCK_T
    sorted_group = keys // BLOCK_T
    tl.store(sorted_tokens_ptr + t, order, mask=valid)
    has_lora = sorted_group < num_slots
    owner = tl.where(has_lora, sorted_group, 0)
    tl.store(sorted_slots_ptr + t, tl.where(has_lora, sorted_group, -1), mask=valid)
    tl.store(sorted_ranks_ptr + t, tl.load(slot_ranks_ptr + owner, mask=has_lora, other=0), mask=valid)
    tl.store(sorted_scales_ptr + t, tl.load(slot_scales_ptr + owner, mask=has_lora, other=0.0), mask=valid)
    j = tl.arange(0, PAGES_PAD)
    page_ok = valid[:, None] & (j < pages_per_slot)[None, :]
    pages = tl.load(slot_pages_ptr + owner[:, None] * pages_per_slot + j[None, :], mask=page_ok, other=0)
    tl.store(sorted_pages_ptr + t[:, None] * pages_per_slot + j[None, :], pages, mask=page_ok)

    tl.store(group_counts_ptr + bins, counts, mask=bins <= num_slots)
    active = (bins < num_slots) & (counts > 0)
    # slots with tokens first, ascending, then the rest: a key sort again
    slot_keys = tl.sort(tl.where(active, bins, BINS + bins))
    tl.store(active_slots_ptr + bins, tl.where(slot_keys < BINS, slot_keys, -1), mask=bins < num_slots)
    tl.store(num_active_ptr, tl.sum(active.to(tl.int32), axis=0))


@triton.jit
def _write_tile_map(map_ptr, counts, num_slots, map_rows, height, ROWS_PAD: tl.constexpr):
    """The map_rows rows [map_rows, 4] at map_ptr of tiles of `height` rows, from the group counts
    ([BINS], 0 past group S): per group in [BINS] and per program in [ROWS_PAD] registers."""
    starts = tl.cumsum(counts, 0) - counts
    tiles = (counts + height - 1) // height
    ends = tl.cumsum(tiles, 0)  # <= map_rows < ROWS_PAD
    # program p's group: how many groups' tiles end at or before p (a search of every p at once)
    group = tl.cumsum(tl.histogram(ends, ROWS_PAD), 0)
    p = tl.arange(0, ROWS_PAD)
    mine = p < tl.sum(tiles, 0)
    group = tl.where(mine, group, 0)  # a valid index for the gathers; rows past the tiles are empty
    row0 = (p - tl.gather(ends - tiles, group, 0)) * height
    count = tl.gather(counts, group, 0)
    start = tl.gather(starts, group, 0)
    # [ROWS_PAD, 2, 2] holding field 2i + j at [p, i, j]: join stacks along a new last axis j, so
    # its first operand holds fields 0 and 2 (i = 0, 1), its second fields 1 and 3
    fields = tl.join(
        tl.join(tl.where(mine, group, num_slots + 1), tl.where(mine, count, 0)),
        tl.join(tl.where(mine, row0, 0), tl.where(mine, start, 0)),
    )
    rows = map_ptr + p[:, None] * 4 + tl.arange(0, 4)[None, :]
    tl.store(rows, tl.reshape(fields, (ROWS_PAD, 4)), mask=(p < map_rows)[:, None])


@dataclass(slots=True)
class LoRABatch:
    token_slots: torch.Tensor  # int32 [T]: adapter slot of each token, -1 for the base model
    slot_ranks: torch.Tensor  # int32 [S]: rank of the adapter in each slot (0 for an empty slot)
    slot_scales: torch.Tensor  # float32 [S]: alpha/r (or alpha/sqrt(r) with rsLoRA) per slot
    # int32 [S, pages_per_slot]: page table, slot s's rank rows [j * PR, (j + 1) * PR) in page
    # slot_pages[s, j]; entries past cdiv(slot_ranks[s], PR) hold any page in [0, P), never read
    slot_pages: torch.Tensor
    sorted_tokens: torch.Tensor = field(init=False)  # int32 [T]: token ids grouped by slot, base last
    group_counts: torch.Tensor = field(init=False)  # int32 [S + 1]: tokens per group (see above)
    active_slots: torch.Tensor = field(init=False)  # int32 [S]: slots with tokens first, then -1
    num_active: torch.Tensor = field(init=False)  # int32 [1]: how many entries of active_slots are set
    sorted_slots: torch.Tensor = field(init=False)  # int32 [T]: slot at each sorted position, -1 without LoRA
    sorted_ranks: torch.Tensor = field(init=False)  # int32 [T]: its rank, 0 without LoRA
    sorted_scales: torch.Tensor = field(init=False)  # float32 [T]: its scale
    sorted_pages: torch.Tensor = field(init=False)  # int32 [T, pages_per_slot]: its page table row, unread without LoRA
    # int32 [len(TILE_HEIGHTS), max_token_tiles(T, S + 1, 16), 4]: per tile height, each program's
    # (group, first row, count, start), empty past the last tile (see above); read it through token_tiles
    tile_map: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.token_slots.dim() != 1 or self.slot_ranks.dim() != 1 or self.slot_scales.dim() != 1:
            raise ValueError("token_slots, slot_ranks and slot_scales must be 1-D")
        if self.slot_ranks.shape != self.slot_scales.shape:
            raise ValueError(
                f"slot_ranks {tuple(self.slot_ranks.shape)} and slot_scales "
                f"{tuple(self.slot_scales.shape)} must describe the same slots"
            )
        if self.slot_pages.dim() != 2 or self.slot_pages.shape[0] != self.slot_ranks.shape[0]:
            raise ValueError(
                f"slot_pages {tuple(self.slot_pages.shape)} must be [S={self.slot_ranks.shape[0]}, pages_per_slot]"
            )
        if self.slot_pages.shape[1] == 0:
            raise ValueError("slot_pages must give every slot at least one page")
        device = self.token_slots.device
        self.token_slots = self.token_slots.to(torch.int32)
        self.slot_ranks = self.slot_ranks.to(device=device, dtype=torch.int32).contiguous()
        self.slot_scales = self.slot_scales.to(device=device, dtype=torch.float32).contiguous()
        # no copy when the caller's table is already an int32 tensor on the device (a CUDA graph
        # captured over this build then reads the caller's persistent table)
        self.slot_pages = self.slot_pages.to(device=device, dtype=torch.int32).contiguous()
        if self.token_slots.is_cuda and self.num_slots > 0 and self.num_tokens <= MAX_KERNEL_TOKENS:
            self._build_on_device()
        else:
            self._build_with_torch()

    def _build_on_device(self) -> None:
        """The sorted and grouped fields in one Triton launch (see the module docstring)."""
        device, num_tokens, num_slots = self.token_slots.device, self.num_tokens, self.num_slots
        self.token_slots = self.token_slots.contiguous()
        int32 = {"dtype": torch.int32, "device": device}
        self.sorted_tokens = torch.empty(num_tokens, **int32)
        self.group_counts = torch.empty(num_slots + 1, **int32)
        self.active_slots = torch.empty(num_slots, **int32)
        self.num_active = torch.empty(1, **int32)
        self.sorted_slots = torch.empty(num_tokens, **int32)
        self.sorted_ranks = torch.empty(num_tokens, **int32)
        self.sorted_scales = torch.empty(num_tokens, dtype=torch.float32, device=device)
        self.sorted_pages = torch.empty(num_tokens, self.pages_per_slot, **int32)
        map_rows = self.map_rows
        self.tile_map = torch.empty(len(TILE_HEIGHTS), map_rows, 4, **int32)
        if num_tokens == 0:
            self.group_counts.zero_()
            self.active_slots.fill_(-1)
            self.num_active.zero_()
            return
        _build_kernel[(1 + len(TILE_HEIGHTS),)](
            self.token_slots, self.slot_ranks, self.slot_scales, self.slot_pages,
            self.sorted_tokens, self.group_counts, self.active_slots, self.num_active,
            self.sorted_slots, self.sorted_ranks, self.sorted_scales, self.sorted_pages, self.tile_map,
            num_tokens, num_slots, self.pages_per_slot, map_rows,
            BLOCK_T=triton.next_power_of_2(num_tokens), BINS=triton.next_power_of_2(num_slots + 2),
            PAGES_PAD=triton.next_power_of_2(self.pages_per_slot), ROWS_PAD=triton.next_power_of_2(map_rows + 1),
            MIN_HEIGHT=TILE_HEIGHTS[0],
            num_warps=4 if num_tokens <= 256 else 8,
        )  # fmt: skip

    def _build_with_torch(self) -> None:
        """The sorted and grouped fields with torch ops: CPU tensors, large batches, the oracle."""
        device = self.token_slots.device
        num_slots = self.slot_ranks.shape[0]

        slots = self.token_slots.long()
        rank_of_token = self.slot_ranks[slots.clamp(min=0)] if num_slots else torch.zeros_like(slots)
        group = torch.where((slots >= 0) & (rank_of_token > 0), slots, num_slots)
        sorted_group, order = torch.sort(group, stable=True)
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        counts.index_add_(0, group, torch.ones_like(group, dtype=torch.int32))
        self.sorted_tokens = order.to(torch.int32)
        self.group_counts = counts
        has_lora = sorted_group < num_slots
        self.sorted_slots = torch.where(has_lora, sorted_group, -1).to(torch.int32)
        self.sorted_ranks = torch.where(has_lora, rank_of_token[order], 0).to(torch.int32)
        scale_of_token = self.slot_scales[slots.clamp(min=0)] if num_slots else torch.zeros(slots.shape, device=device)
        self.sorted_scales = torch.where(has_lora, scale_of_token[order], 0.0)
        self.sorted_pages = (
            self.slot_pages[self.sorted_slots.long().clamp(min=0)]
            if num_slots
            else torch.zeros((slots.shape[0], self.pages_per_slot), dtype=torch.int32, device=device)
        )

        active = counts[:num_slots] > 0
        _, slot_order = torch.sort((~active).to(torch.int8), stable=True)
        self.active_slots = torch.where(active[slot_order], slot_order, -1).to(torch.int32)
        self.num_active = active.sum(dtype=torch.int32).reshape(1)
        self.tile_map = _tile_map_with_torch(counts, self.map_rows)

    @classmethod
    def build(
        cls, token_slots: torch.Tensor, slot_ranks: torch.Tensor, slot_scales: torch.Tensor, slot_pages: torch.Tensor
    ) -> LoRABatch:
        return cls(token_slots=token_slots, slot_ranks=slot_ranks, slot_scales=slot_scales, slot_pages=slot_pages)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_ranks.shape[0]

    @property
    def pages_per_slot(self) -> int:
        return self.slot_pages.shape[1]

    @property
    def map_rows(self) -> int:
        """Rows of each tile map: the most programs a launch over the S + 1 groups has."""
        return max_token_tiles(self.num_tokens, self.num_slots + 1, min(TILE_HEIGHTS))

    def token_tiles(self, block_m: int) -> torch.Tensor:
        """The tile map of BLOCK_M-row tiles, int32 [map_rows, 4] (contiguous, 16-byte rows)."""
        if block_m not in TILE_HEIGHTS:
            raise ValueError(f"block_m {block_m} has no tile map: the token tiles are {TILE_HEIGHTS} rows high")
        return self.tile_map[TILE_HEIGHTS.index(block_m)]


def _tile_map_with_torch(counts: torch.Tensor, map_rows: int) -> torch.Tensor:
    """LoRABatch.tile_map from the group counts [S + 1], with torch ops (the build kernel's oracle)."""
    empty_group = counts.shape[0]  # S + 1
    p = torch.arange(map_rows, device=counts.device)
    starts = counts.cumsum(0) - counts
    maps = []
    for height in TILE_HEIGHTS:
        tiles = (counts + height - 1) // height
        ends = tiles.cumsum(0)
        group = torch.searchsorted(ends, p, right=True)  # how many groups' tiles end at or before p
        mine = p < ends[-1]
        group = torch.where(mine, group, 0)
        fields = (group, (p - (ends - tiles)[group]) * height, counts[group], starts[group])
        empty = (empty_group, 0, 0, 0)
        maps.append(torch.stack([torch.where(mine, f, e) for f, e in zip(fields, empty, strict=True)], dim=1))
    return torch.stack(maps).to(torch.int32)
