"""Paged causal attention in plain torch: one sequence at a time, gathering its K/V from the block
table. The semantics the Triton path (paged.py) reproduces; the path taken on CPU.

For sequence s with q_len new tokens and ctx = context_lens[s] cached tokens (new ones included),
new token j sits at position ctx - q_len + j and attends to cache positions 0 … ctx - q_len + j.
An fp8 cache's per-head scales (kernels/attention/__init__.py) are applied in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant.reference import FP8_DTYPE


def check_out(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`out` if it can take attention's output for q [T, H, D]: same shape and dtype, last axis contiguous."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be q's shape {tuple(q.shape)} and dtype {q.dtype}")
    return out


def check_kv_scales(kv_scales: torch.Tensor | None, key_cache: torch.Tensor) -> torch.Tensor | None:
    """`kv_scales` if the cache [num_blocks, block_size, H_kv, D] can take them: float32 [2, H_kv],
    contiguous, required for an fp8 cache; a cache in the activations' dtype holds K/V as they are
    and reads no scales (None is returned for it)."""
    if key_cache.dtype != FP8_DTYPE:
        return None
    num_kv_heads = key_cache.shape[2]
    if kv_scales is None:
        raise ValueError("an fp8 KV cache needs kv_scales (float32 [2, H_kv])")
    if kv_scales.shape != (2, num_kv_heads) or kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous():
        raise ValueError(f"kv_scales {tuple(kv_scales.shape)} {kv_scales.dtype} must be contiguous float32 "
                         f"[2, {num_kv_heads}]")  # fmt: skip
    return kv_scales


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim]: one sequence's cached K (or V), in position order.

    cache [num_blocks, block_size, num_kv_heads, head_dim]; block_table int32 [max_blocks_per_seq].
    """
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def paged_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, num_heads, head_dim] for q [T, num_heads, head_dim] over K/V already in the cache,
    written into `out` when given (a static buffer a graph reads next).

    key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim]; num_heads is a multiple
    of num_kv_heads (GQA: query head h reads kv head h // (num_heads / num_kv_heads)).
    query_start_loc int32 [B + 1]; context_lens int32 [B]; block_tables int32 [B, max_blocks_per_seq].
    kv_scales float32 [2, num_kv_heads]: an fp8 cache's K and V scales (check_kv_scales).
    max_query_len is accepted for the Triton path's signature and unused here.

    An fp8 cache is attended in float32 whatever q's dtype: K's scale multiplied into K's widened
    entries (the same as into the scores, to float32 rounding), V's into the output, which is then
    rounded to q's dtype once.
    """
    out = torch.empty_like(q) if out is None else check_out(out, q)
    kv_scales = check_kv_scales(kv_scales, key_cache)
    # fp8 entries widen exactly to bf16, fp16 and fp32; a scaled cache is attended in fp32
    compute = q.dtype if kv_scales is None else torch.float32
    starts = query_start_loc.tolist()  # host copies: the loop below is host-driven anyway
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        keys = gather_context(key_cache, block_tables[seq], context_len).to(compute)  # [ctx, H_kv, D]
        values = gather_context(value_cache, block_tables[seq], context_len).to(compute)
        if kv_scales is not None:
            keys = keys * kv_scales[0, :, None]
        query_positions = torch.arange(context_len - (end - start), context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= query_positions[:, None]  # [q_len, ctx]
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).to(compute),  # [num_heads, q_len, head_dim]
            keys.transpose(0, 1),  # [num_kv_heads, ctx, head_dim]
            values.transpose(0, 1),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)  # [q_len, num_heads, head_dim]
        if kv_scales is not None:  # query head h reads KV head h // group
            group = q.shape[1] // key_cache.shape[2]
            attended = attended * kv_scales[1].repeat_interleave(group)[:, None]
        out[start:end] = attended
    return out
