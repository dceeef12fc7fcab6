"""Paged causal attention over a flat token batch (prefill chunks and decodes in one call).

Semantics (reference.py is the oracle): for sequence s with q_len new tokens and ctx cached tokens
(new ones included), new token j sits at position ctx - q_len + j and attends, per query head h,
to cache positions 0 … ctx - q_len + j of KV head h // (H / H_kv), read through block_tables[s].

The caches hold K/V in q's dtype or in fp8 (--kv-cache-dtype fp8: e4m3, unscaled, saturating at
±448); fp8 entries are widened to q's dtype as they are read, and the scores, the softmax and P·V are
computed as for a cache in q's dtype (fp32 softmax; P·V with P in q's dtype, never in fp8).

CUDA tensors take the Triton kernel (paged.py); anything else takes the torch reference.
"""

from __future__ import annotations

import torch

from kernels.attention.paged import paged_attention_triton
from kernels.attention.reference import paged_attention_reference
from kernels.quant.reference import FP8_DTYPE, to_fp8_saturated

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_triton", "store_kv"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, H_kv, D] into the caches [num_blocks, block_size, H_kv, D] at int64 flat
    slots [T] (block * block_size + offset); into an fp8 cache rounded to nearest, saturating."""
    if key_cache.dtype == FP8_DTYPE:  # as bytes: index_copy_ has no fp8 kernel on CPU
        key, value = to_fp8_saturated(key).view(torch.uint8), to_fp8_saturated(value).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H, D] for q [T, H, D] over K/V already in the cache (shapes: reference.py); into
    `out` [T, H, D] when given."""
    attend = paged_attention_triton if q.is_cuda else paged_attention_reference
    return attend(q, key_cache, value_cache, query_start_loc, context_lens, block_tables, scale, max_query_len, out)
