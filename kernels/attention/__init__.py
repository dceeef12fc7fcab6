"""Paged causal attention over a flat token batch (prefill chunks and decodes in one call).

Semantics (reference.py is the oracle): for sequence s with q_len new tokens and ctx cached tokens
(new ones included), new token j sits at position ctx - q_len + j and attends, per query head h,
to cache positions 0 … ctx - q_len + j of KV head h // (H / H_kv), read through block_tables[s].

The caches hold K/V in q's dtype, or in fp8 (--kv-cache-dtype fp8: e4m3 with one float32 scale per
layer, per KV head and per K / V: kv_scales [2, H_kv], row 0 K's, row 1 V's). An fp8 cache stores
x / scale rounded to e4m3, saturating at ±448 (store_kv, and the fused RoPE + KV write), so a head of
small values still spans e4m3's normal range instead of its subnormals. Attention widens the fp8
entries to q's dtype (exactly) and puts the scales back where they cost one multiply per row, not
one per element:

    scores[j, h, p] = (q[j, h] · K8[p, g]) * scale * k_scale[g]       g = h // (H / H_kv), fp32
    out[j, h]       = (softmax(scores[j, h]) · V8[:, g]) * v_scale[g]  softmax fp32; P·V with P in
                                                                       q's dtype or fp32, never fp8

CUDA tensors take the Triton kernel (paged.py); anything else takes the torch reference.
"""

from __future__ import annotations

import torch

from kernels.attention.paged import paged_attention_triton
from kernels.attention.reference import check_kv_scales, paged_attention_reference
from kernels.quant.reference import to_fp8_saturated

__all__ = ["check_kv_scales", "paged_attention", "paged_attention_reference", "paged_attention_triton", "store_kv"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, H_kv, D] into the caches [num_blocks, block_size, H_kv, D] at int64 flat
    slots [T] (block * block_size + offset); into an fp8 cache each value divided (in fp32) by its
    head's scale (kv_scales float32 [2, H_kv]: K's, V's), then rounded to nearest e4m3, saturating."""
    kv_scales = check_kv_scales(kv_scales, key_cache)
    if kv_scales is not None:  # as bytes: index_copy_ has no fp8 kernel on CPU
        # a tensor divisor: a true division on every device, as the Triton kernel divides
        key = to_fp8_saturated(key.float() / kv_scales[0, :, None]).view(torch.uint8)
        value = to_fp8_saturated(value.float() / kv_scales[1, :, None]).view(torch.uint8)
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
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H, D] for q [T, H, D] over K/V already in the cache (shapes: reference.py); into
    `out` [T, H, D] when given. kv_scales float32 [2, H_kv]: an fp8 cache's scales (K's, V's)."""
    attend = paged_attention_triton if q.is_cuda else paged_attention_reference
    return attend(
        q, key_cache, value_cache, query_start_loc, context_lens, block_tables, scale, max_query_len, out, kv_scales
    )
