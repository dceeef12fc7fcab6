"""The paged KV cache's storage: one K and one V tensor per layer, carved into fixed-size blocks.

Which blocks belong to which sequence is the (torch-free) block manager's business; this module only
owns the memory. The layers' tensors are views of one flat byte buffer, so a worker that switches
base models can hand the same buffer from the outgoing model to the incoming one (whose layer count,
heads and dtype may differ): the incoming model's decode graphs can be captured against their final
addresses while the outgoing model still serves from that buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant import FP8_DTYPE
from shared.model_info import ModelInfo


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one model's cache: what a block costs and how the layers are cut from the buffer."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, info: ModelInfo, block_size: int, dtype: torch.dtype) -> KVLayout:
        """`info`'s cache for activations of `dtype`: in that dtype, or fp8 (e4m3, half the bytes of
        bf16) when the model is served with --kv-cache-dtype fp8."""
        cache_dtype = FP8_DTYPE if info.kv_cache_dtype == "fp8" else dtype
        return cls(info.num_layers, block_size, info.num_kv_heads, info.head_dim, cache_dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def blocks_in(self, nbytes: int) -> int:
        return nbytes // self.bytes_per_block


@dataclass(slots=True)
class KVCache:
    key: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    value: list[torch.Tensor]  # per layer: same shape as key
    block_size: int

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, device: torch.device) -> KVCache:
        """A new, zeroed cache of `num_blocks` blocks."""
        storage = torch.zeros(num_blocks * layout.bytes_per_block, dtype=torch.uint8, device=device)
        return cls.carve(layout, num_blocks, storage)

    @classmethod
    def carve(cls, layout: KVLayout, num_blocks: int, storage: torch.Tensor) -> KVCache:
        """Views of the flat uint8 `storage` as a cache of `num_blocks` blocks; its contents are left
        as they are (attention reads only positions a sequence has written)."""
        if storage.dtype != torch.uint8 or storage.dim() != 1:
            raise ValueError("KV storage must be a flat uint8 tensor")
        if num_blocks * layout.bytes_per_block > storage.numel():
            raise ValueError(f"{num_blocks} KV blocks need {num_blocks * layout.bytes_per_block} bytes, "
                             f"the storage has {storage.numel()}")  # fmt: skip
        shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        per_tensor = layout.bytes_per_block // (2 * layout.num_layers) * num_blocks
        tensors = storage[: 2 * layout.num_layers * per_tensor].view(layout.dtype).view(2 * layout.num_layers, *shape)
        return cls(key=list(tensors[0::2].unbind()), value=list(tensors[1::2].unbind()), block_size=layout.block_size)
