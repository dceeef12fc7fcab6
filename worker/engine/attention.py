"""Paged attention as the model calls it: write this step's K/V into the cache, then attend.

The one seam where the engine meets the attention kernels; `kernels.attention` picks the Triton
kernel for CUDA tensors and the torch reference elsewhere.
"""

from __future__ import annotations

import torch

from kernels.attention import paged_attention as attend
from kernels.attention import store_kv
from worker.engine.forward_batch import ForwardBatch


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
    return attend(
        q,
        key_cache,
        value_cache,
        batch.query_start_loc,
        batch.context_lens,
        batch.block_tables,
        scale,
        batch.max_query_len,
    )
