"""Paged attention as the model calls it: write this step's K/V into the cache, then attend.

The one seam where the attention implementation is chosen; today every device runs the torch
reference (attention_reference.py), a fused GPU path will be picked here.
"""

from __future__ import annotations

import torch

from worker.engine.attention_reference import paged_attention_reference
from worker.engine.forward_batch import ForwardBatch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] at flat slots (block * block_size + offset)."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's whole context, after
    caching this step's k/v [T, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim]."""
    store_kv(k, v, key_cache, value_cache, batch.slot_mapping)
    return paged_attention_reference(
        q, key_cache, value_cache, batch.query_start_loc, batch.context_lens, batch.block_tables, scale
    )
