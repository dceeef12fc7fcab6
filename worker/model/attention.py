"""Paged attention as the model calls it: attend over each sequence's cached K/V.

The one seam where the engine meets the attention kernels; `kernels.attention` picks the Triton
kernel for CUDA tensors and the torch reference elsewhere. The step's own K/V are already in the
cache (kernels.fused.rope_and_cache_kv writes them together with the rotation).
"""

from __future__ import annotations

import torch

from kernels.attention import paged_attention as attend
from worker.model.forward_batch import ForwardBatch


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    kv_scales: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's whole context, this
    step's tokens included. kv_scales float32 [2, num_kv_heads]: the layer's fp8 K and V scales
    (unread for a cache in the activations' dtype). Returns [T, num_heads, head_dim], written into
    `out` when given."""
    return attend(
        q,
        key_cache,
        value_cache,
        batch.query_start_loc,
        batch.context_lens,
        batch.block_tables,
        scale,
        batch.max_query_len,
        out,
        kv_scales,
    )
