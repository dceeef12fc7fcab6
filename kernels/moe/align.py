"""Sorting (token, k) pairs into block-padded groups: the metadata every MoE kernel tiles over.

A pair p = t * top_k + k is token t's k-th routed expert. Pairs are grouped — by expert for the base
GEMMs, by (adapter slot, expert) for the LoRA kernels — and each group is padded to a multiple of
BLOCK_M, so one tile of BLOCK_M rows never mixes weights. Built with device ops of fixed output size
(no host sync, capturable in a CUDA graph): unused tail blocks have group -1 and kernels exit there.

    groups of pairs = [1, 0, 1, 1, 2]       (G = 3, BLOCK_M = 2, P = 5)
    sorted_pairs    = [1, 5, 0, 2, 3, 5, 4, 5, (5 …)]      P marks padding
    block_groups    = [0, 1, 1, 2, (-1 …)]
"""

from __future__ import annotations

import torch

from kernels.moe.align_large import align_pairs_large
from kernels.moe.align_small import SMALL_PAIRS, align_pairs_small
from kernels.moe.pair_blocks import PairBlocks, max_blocks


def align_pairs(groups: torch.Tensor, num_groups: int, block_m: int) -> PairBlocks:
    """Pairs grouped and block-padded, in torch (the CPU path and the Triton kernels' reference).
    groups: int [P], the group of each pair in 0..num_groups-1, or num_groups (or more) for a pair
    no kernel should see (a token without an adapter)."""
    num_pairs = groups.shape[0]
    device = groups.device
    groups = groups.long().clamp(max=num_groups)  # one "skipped" group past the real ones
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, groups, torch.ones_like(groups))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_groups] = 0  # skipped pairs get no rows
    padded_ends = torch.cumsum(padded, 0)
    group_starts = padded_ends - padded
    count_starts = torch.cumsum(counts, 0) - counts

    sorted_groups, order = torch.sort(groups, stable=True)
    rank_in_group = torch.arange(num_pairs, device=device) - count_starts[sorted_groups]
    destination = group_starts[sorted_groups] + rank_in_group
    blocks = max_blocks(num_pairs, num_groups, block_m)
    rows = blocks * block_m
    destination = torch.where(sorted_groups < num_groups, destination, rows)  # skipped → a dump row
    sorted_pairs = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))

    block_starts = torch.arange(blocks, device=device) * block_m
    block_groups = torch.searchsorted(padded_ends, block_starts, right=True)
    block_groups = torch.where(block_starts < padded_ends[-1], block_groups, -1).to(torch.int32)
    return PairBlocks(sorted_pairs[:rows], block_groups, block_m, num_pairs)


def _align_triton(
    ids: torch.Tensor, num_experts: int, num_groups: int, block_m: int, token_slots: torch.Tensor | None = None
) -> PairBlocks:
    """On CUDA: one launch up to SMALL_PAIRS pairs (align_small.py), three past that (align_large.py);
    both form the groups from ids and token_slots themselves."""
    align = align_pairs_small if ids.numel() <= SMALL_PAIRS else align_pairs_large
    return align(ids.contiguous(), num_experts, num_groups, block_m, token_slots)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    """Pairs of ids int [T, K] grouped by expert."""
    if ids.is_cuda:
        return _align_triton(ids, num_experts, num_experts, block_m)
    return align_pairs(ids.reshape(-1), num_experts, block_m)


def adapter_expert_blocks(
    ids: torch.Tensor, token_slots: torch.Tensor, num_slots: int, num_experts: int, block_m: int
) -> PairBlocks:
    """Pairs grouped by (adapter slot, expert), group = slot * E + expert; tokens whose slot is -1
    are left out. ids int [T, K], token_slots int [T]."""
    if ids.is_cuda:
        return _align_triton(ids, num_experts, num_slots * num_experts, block_m, token_slots.contiguous())
    top_k = ids.shape[1]
    slots = token_slots.to(torch.int32).repeat_interleave(top_k)
    groups = torch.where(slots >= 0, slots * num_experts + ids.reshape(-1), num_slots * num_experts)
    return align_pairs(groups, num_slots * num_experts, block_m)
