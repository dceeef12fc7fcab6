"""align.align_pairs in one launch, for decode-sized batches: one program counts, scans and scatters.

Same output contract as align.align_pairs (pair order inside a group may differ: slots come from
atomic counters; a pair's own result never depends on its tile-mates). The torch version is ~25
small kernels, which at decode sizes cost more than the GEMMs they feed (×2 per MoE layer with
adapters); this is one. A single program walks the pairs serially, so it is only for small counts:
align.py takes it up to SMALL_PAIRS pairs on CUDA and align_large.py's three launches past that.

The kernels read the router's expert ids (and each token's adapter slot) and form each pair's group
themselves, so building the (adapter, expert) groups costs no launches of its own:

    phase 0  zero the per-group counters, fill sorted_pairs with the padding id
    phase 1  counts[g] += 1 per pair (atomics)
    phase 2  exclusive scan of the block-padded counts → each group's first row (cursor) and end
    phase 3  block_groups[b] = the group whose rows hold row b * BLOCK_M (binary search over ends)
    phase 4  each pair takes the next row of its group (atomic cursor) and is written there
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.pair_blocks import PairBlocks, max_blocks

# Up to this many pairs the one program beats align_large.py's three launches; past it its serial
# walk, which grows with the pairs, loses (per-size figures: docs/benchmarks.md, "Figures behind
# code comments").
SMALL_PAIRS = 2048


@triton.jit
def pair_groups(ids_ptr, slots_ptr, pairs, pair_ok, num_experts, num_groups,
                TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr):  # fmt: skip
    """Group of each pair p = t * TOP_K + k: its expert ids[p], or with slots slot[t] * E + ids[p];
    num_groups (left out) for a token without an adapter and for pairs past the end."""
    expert = tl.load(ids_ptr + pairs, mask=pair_ok, other=0).to(tl.int32)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + pairs // TOP_K, mask=pair_ok, other=-1).to(tl.int32)
        group = tl.where(slot >= 0, slot * num_experts + expert, num_groups)
    else:
        group = expert
    return tl.where(pair_ok, group, num_groups)


@triton.jit
def scan_groups(counts_ptr, cursors_ptr, block_groups_ptr, num_groups, num_blocks,
                BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr):  # fmt: skip
    """Phases 2 and 3 in one program: counts → each group's first row in cursors, its end row back
    in counts, and the group of every block."""
    offs = tl.arange(0, CHUNK)
    total = 0
    for start in range(0, num_groups, CHUNK):
        ok = start + offs < num_groups
        padded = (tl.load(counts_ptr + start + offs, mask=ok, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = total + tl.cumsum(padded, 0)
        tl.store(cursors_ptr + start + offs, ends - padded, mask=ok)
        tl.store(counts_ptr + start + offs, ends, mask=ok)  # counts now hold each group's end row
        total += tl.sum(padded, 0)
    tl.debug_barrier()
    for start in range(0, num_blocks, CHUNK):
        block_ok = start + offs < num_blocks
        row = (start + offs) * BLOCK_M
        low = tl.zeros((CHUNK,), dtype=tl.int32)
        high = tl.zeros((CHUNK,), dtype=tl.int32) + num_groups
        for _ in tl.static_range(SEARCH_STEPS):  # first group whose end is past `row`
            mid = (low + high) // 2
            end = tl.load(counts_ptr + mid, mask=block_ok & (low < high), other=0)
            past = end > row
            high = tl.where((low < high) & past, mid, high)
            low = tl.where((low < high) & ~past, mid + 1, low)
        tl.store(block_groups_ptr + start + offs, tl.where(row < total, low, -1), mask=block_ok)


@triton.jit(do_not_specialize=["num_pairs", "num_rows", "num_blocks"])
def _align_small_kernel(
    ids_ptr, slots_ptr, sorted_pairs_ptr, block_groups_ptr, counts_ptr, cursors_ptr,
    num_pairs, num_experts, num_groups, num_rows, num_blocks,
    TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    offs = tl.arange(0, CHUNK)
    for start in range(0, num_groups, CHUNK):
        ok = start + offs < num_groups
        tl.store(counts_ptr + start + offs, 0, mask=ok)
    for start in range(0, num_rows, CHUNK):
        tl.store(sorted_pairs_ptr + start + offs, num_pairs, mask=start + offs < num_rows)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        pair_ok = start + offs < num_pairs
        group = pair_groups(ids_ptr, slots_ptr, start + offs, pair_ok, num_experts, num_groups, TOP_K, HAS_SLOTS)
        tl.atomic_add(counts_ptr + group, 1, mask=group < num_groups)
    tl.debug_barrier()
    scan_groups(counts_ptr, cursors_ptr, block_groups_ptr, num_groups, num_blocks, BLOCK_M, CHUNK, SEARCH_STEPS)
    for start in range(0, num_pairs, CHUNK):
        pair_ok = start + offs < num_pairs
        group = pair_groups(ids_ptr, slots_ptr, start + offs, pair_ok, num_experts, num_groups, TOP_K, HAS_SLOTS)
        placed = group < num_groups
        row = tl.atomic_add(cursors_ptr + group, 1, mask=placed)
        tl.store(sorted_pairs_ptr + row, start + offs, mask=placed)


def check_pairs(ids: torch.Tensor, token_slots: torch.Tensor | None) -> None:
    """The kernels index ids [T, K] and token_slots [T] as flat contiguous arrays."""
    if ids.dim() != 2 or not ids.is_contiguous():
        raise ValueError(f"ids {tuple(ids.shape)} must be a contiguous [T, top_k]")
    if token_slots is not None and (token_slots.shape != ids.shape[:1] or not token_slots.is_contiguous()):
        raise ValueError(f"token_slots {tuple(token_slots.shape)} must be a contiguous [T={ids.shape[0]}]")


def align_pairs_small(
    ids: torch.Tensor, num_experts: int, num_groups: int, block_m: int, token_slots: torch.Tensor | None = None
) -> PairBlocks:
    """Pairs of ids int [T, K] (on a CUDA device, or the interpreter) grouped by expert
    (num_groups = num_experts), or with token_slots int [T] by slot * num_experts + expert
    (num_groups = slots * num_experts; slot -1 left out); at most SMALL_PAIRS pairs."""
    check_pairs(ids, token_slots)
    num_pairs = ids.numel()
    if num_pairs > SMALL_PAIRS:
        raise ValueError(f"{num_pairs} pairs: align_pairs_small takes at most {SMALL_PAIRS}")
    blocks = max_blocks(num_pairs, num_groups, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_groups = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    scratch = torch.empty(2, num_groups, dtype=torch.int32, device=ids.device)  # counts (then ends), cursors
    _align_small_kernel[(1,)](
        ids, ids if token_slots is None else token_slots, sorted_pairs, block_groups, scratch[0], scratch[1],
        num_pairs, num_experts, num_groups, blocks * block_m, blocks,
        TOP_K=ids.shape[1], HAS_SLOTS=token_slots is not None, BLOCK_M=block_m, CHUNK=2048,
        SEARCH_STEPS=max(1, num_groups.bit_length()), num_warps=8,
    )  # fmt: skip
    return PairBlocks(sorted_pairs, block_groups, block_m, num_pairs)
