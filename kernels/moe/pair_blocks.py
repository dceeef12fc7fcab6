"""The block-padded pair metadata every MoE kernel tiles over (built by align.py, align_small.py, align_large.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PairBlocks:
    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m]: pair ids by group, padded with num_pairs
    block_groups: torch.Tensor  # int32 [max_blocks]: group of each block, -1 past the last used block
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.block_groups.shape[0]


def max_blocks(num_pairs: int, num_groups: int, block_m: int) -> int:
    """Blocks enough for any grouping: each non-empty group wastes at most block_m - 1 rows."""
    padded = num_pairs + min(num_groups, num_pairs) * (block_m - 1)
    return max(1, -(-padded // block_m))
