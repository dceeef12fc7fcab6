"""align.align_pairs in one launch, for decode-sized batches: one program counts, scans and scatters.

Same output contract as align.align_pairs (pair order inside a group may differ: slots come from
atomic counters; a pair's own result never depends on its tile-mates). The torch version is ~25
small kernels, which at decode sizes cost more than the GEMMs they feed (×2 per MoE layer with
adapters); this is one. A single program walks the pairs serially, so it is only for small counts:
align.align_pairs takes it up to SMALL_PAIRS pairs on CUDA and the torch version above.

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

# Measured on the H200 (bench/tune_moe.py, eager): this kernel with its launch 0.025-0.037 ms up to
# 2,048 pairs; the torch version 0.72 ms at 12,800 pairs, nearly all launch cost. The serial walk
# grows with the pairs, so past this the torch version's sort wins (a guess, not measured).
SMALL_PAIRS = 32768


@triton.jit(do_not_specialize=["num_pairs", "num_rows", "num_blocks"])
def _align_small_kernel(
    groups_ptr, sorted_pairs_ptr, block_groups_ptr, counts_ptr, cursors_ptr,
    num_pairs, num_groups, num_rows, num_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
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
        group = tl.load(groups_ptr + start + offs, mask=pair_ok, other=num_groups)
        counted = pair_ok & (group < num_groups)
        tl.atomic_add(counts_ptr + group, 1, mask=counted)
    tl.debug_barrier()
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
    for start in range(0, num_pairs, CHUNK):
        pair_ok = start + offs < num_pairs
        group = tl.load(groups_ptr + start + offs, mask=pair_ok, other=num_groups)
        placed = pair_ok & (group < num_groups)
        row = tl.atomic_add(cursors_ptr + group, 1, mask=placed)
        tl.store(sorted_pairs_ptr + row, start + offs, mask=placed)


def align_pairs_small(groups: torch.Tensor, num_groups: int, block_m: int) -> PairBlocks:
    """align.align_pairs for up to SMALL_PAIRS pairs; groups int [P] on a CUDA device (or the
    interpreter), num_groups (or more) marking pairs to leave out."""
    num_pairs = groups.shape[0]
    groups = groups.to(torch.int32)  # no copy when it already is
    if num_pairs > SMALL_PAIRS:
        raise ValueError(f"{num_pairs} pairs: align_pairs_small takes at most {SMALL_PAIRS}")
    blocks = max_blocks(num_pairs, num_groups, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=groups.device)
    block_groups = torch.empty(blocks, dtype=torch.int32, device=groups.device)
    scratch = torch.empty(2, num_groups, dtype=torch.int32, device=groups.device)  # counts (then ends), cursors
    _align_small_kernel[(1,)](
        groups, sorted_pairs, block_groups, scratch[0], scratch[1],
        num_pairs, num_groups, blocks * block_m, blocks,
        BLOCK_M=block_m, CHUNK=2048, SEARCH_STEPS=max(1, num_groups.bit_length()), num_warps=8,
    )  # fmt: skip
    return PairBlocks(sorted_pairs, block_groups, block_m, num_pairs)
