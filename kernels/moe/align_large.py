"""align.align_pairs for prefill-sized batches: three launches, the count and the scatter spread over
many programs (align_small.py's single program walks the pairs serially).

Same output contract as align.align_pairs (pair order inside a group may differ: rows come from
atomic cursors), and the groups are formed in the kernels as in align_small.py:

    count    (rows / CHUNK programs)  fill sorted_pairs with the padding id; counts[g] += 1 per pair
    scan     (one program)            align_small.scan_groups: first row and end of each group, and
                                      the group of every block
    place    (pairs / CHUNK programs) each pair takes the next row of its group (atomic cursor)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.align_small import check_pairs, pair_groups, scan_groups
from kernels.moe.pair_blocks import PairBlocks, max_blocks

_CHUNK = 1024  # pairs (and padding rows) per program of the count and place launches


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _count_kernel(
    ids_ptr, slots_ptr, sorted_pairs_ptr, counts_ptr,
    num_pairs, num_experts, num_groups, num_rows,
    TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_pairs_ptr + offs, num_pairs, mask=offs < num_rows)
    group = pair_groups(ids_ptr, slots_ptr, offs, offs < num_pairs, num_experts, num_groups, TOP_K, HAS_SLOTS)
    tl.atomic_add(counts_ptr + group, 1, mask=group < num_groups)


@triton.jit(do_not_specialize=["num_blocks"])
def _scan_kernel(
    counts_ptr, cursors_ptr, block_groups_ptr, num_groups, num_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    scan_groups(counts_ptr, cursors_ptr, block_groups_ptr, num_groups, num_blocks, BLOCK_M, CHUNK, SEARCH_STEPS)


@triton.jit(do_not_specialize=["num_pairs"])
def _place_kernel(
    ids_ptr, slots_ptr, sorted_pairs_ptr, cursors_ptr,
    num_pairs, num_experts, num_groups,
    TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    group = pair_groups(ids_ptr, slots_ptr, offs, offs < num_pairs, num_experts, num_groups, TOP_K, HAS_SLOTS)
    placed = group < num_groups
    row = tl.atomic_add(cursors_ptr + group, 1, mask=placed)
    tl.store(sorted_pairs_ptr + row, offs, mask=placed)


def align_pairs_large(
    ids: torch.Tensor, num_experts: int, num_groups: int, block_m: int, token_slots: torch.Tensor | None = None
) -> PairBlocks:
    """align_small.align_pairs_small's contract for any number of pairs: ids int [T, K],
    token_slots int [T] or None (grouped by expert alone, num_groups = num_experts)."""
    check_pairs(ids, token_slots)
    num_pairs, top_k = ids.numel(), ids.shape[1]
    slots = ids if token_slots is None else token_slots
    blocks = max_blocks(num_pairs, num_groups, block_m)
    rows = blocks * block_m
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_groups = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    scratch = torch.zeros(2, num_groups, dtype=torch.int32, device=ids.device)  # counts (then ends), cursors
    _count_kernel[(triton.cdiv(rows, _CHUNK),)](
        ids, slots, sorted_pairs, scratch[0], num_pairs, num_experts, num_groups, rows,
        TOP_K=top_k, HAS_SLOTS=token_slots is not None, CHUNK=_CHUNK, num_warps=4,
    )  # fmt: skip
    _scan_kernel[(1,)](
        scratch[0], scratch[1], block_groups, num_groups, blocks,
        BLOCK_M=block_m, CHUNK=2048, SEARCH_STEPS=max(1, num_groups.bit_length()), num_warps=8,
    )  # fmt: skip
    if num_pairs:
        _place_kernel[(triton.cdiv(num_pairs, _CHUNK),)](
            ids, slots, sorted_pairs, scratch[1], num_pairs, num_experts, num_groups,
            TOP_K=top_k, HAS_SLOTS=token_slots is not None, CHUNK=_CHUNK, num_warps=4,
        )  # fmt: skip
    return PairBlocks(sorted_pairs, block_groups, block_m, num_pairs)
