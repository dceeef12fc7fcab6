"""The paged KV cache's storage: one K and one V tensor per layer, carved into fixed-size blocks.

Which blocks belong to which sequence is the (torch-free) block manager's business; this module only
owns the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVCache:
    key: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    value: list[torch.Tensor]  # per layer: same shape as key
    block_size: int

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            key=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            value=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            block_size=block_size,
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element
