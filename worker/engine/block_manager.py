"""KV-cache block bookkeeping (torch-free): which cache blocks each sequence owns. Every block has
one owner (no prefix sharing): a freed sequence's blocks go straight back to the free list.
"""

from __future__ import annotations

from collections import deque

from worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` tokens have cache slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to cover `num_tokens` tokens. Call `can_allocate` first."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache: {needed} blocks needed, {len(self._free)} free")
        for _ in range(needed):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s blocks; its cached tokens are forgotten."""
        self._free.extendleft(reversed(seq.block_table))  # most recently freed first, in table order
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of the token at `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
