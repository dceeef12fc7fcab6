"""Random paged-attention inputs: sequences with scattered cache blocks, new tokens at the end."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionCase:
    q: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks], -1 where unused
    scale: float
    max_query_len: int

    def args(self) -> tuple:
        return (
            self.q,
            self.key_cache,
            self.value_cache,
            self.query_start_loc,
            self.context_lens,
            self.block_tables,
            self.scale,
            self.max_query_len,
        )


def make_case(
    lens: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
) -> AttentionCase:
    """lens: (q_len, context_len) per sequence, q_len <= context_len. The cache holds random K/V in
    every slot (also those no sequence owns, so a read outside a block table shows up)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    tables, taken = [], 0
    for count in blocks_per_seq:
        tables.append(order[taken : taken + count] + [-1] * (max_blocks - count))
        taken += count
    num_tokens = sum(q for q, _ in lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype=dtype, device=device)

    starts = [0]
    for q_len, _ in lens:
        starts.append(starts[-1] + q_len)
    return AttentionCase(
        q=rand(num_tokens, num_heads, head_dim),
        key_cache=rand(*shape),
        value_cache=rand(*shape),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor([ctx for _, ctx in lens], dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        max_query_len=max(q for q, _ in lens),
    )
