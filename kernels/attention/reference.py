"""Paged causal attention in plain torch: one sequence at a time, gathering its K/V from the block
table. The semantics the Triton path (paged.py) reproduces; the path taken on CPU.

For sequence s with q_len new tokens and ctx = context_lens[s] cached tokens (new ones included),
new token j sits at position ctx - q_len + j and attends to cache positions 0 … ctx - q_len + j.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_out(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`out` if it can take attention's output for q [T, H, D]: same shape and dtype, last axis contiguous."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be q's shape {tuple(q.shape)} and dtype {q.dtype}")
    return out


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
) -> torch.Tensor:
    """out [T, num_heads, head_dim] for q [T, num_heads, head_dim] over K/V already in the cache,
    written into `out` when given (a static buffer a graph reads next).

    key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim]; num_heads is a multiple
    of num_kv_heads (GQA: query head h reads kv head h // (num_heads / num_kv_heads)).
    query_start_loc int32 [B + 1]; context_lens int32 [B]; block_tables int32 [B, max_blocks_per_seq].
    max_query_len is accepted for the Triton path's signature and unused here.
    """
    out = torch.empty_like(q) if out is None else check_out(out, q)
    starts = query_start_loc.tolist()  # host copies: the loop below is host-driven anyway
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        # an fp8 cache widened to q's dtype: every fp8 value is exact in bf16, fp16 and fp32
        keys = gather_context(key_cache, block_tables[seq], context_len).to(q.dtype)
        values = gather_context(value_cache, block_tables[seq], context_len).to(q.dtype)
        query_positions = torch.arange(context_len - (end - start), context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= query_positions[:, None]  # [q_len, ctx]
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [num_heads, q_len, head_dim]
            keys.transpose(0, 1),  # [num_kv_heads, ctx, head_dim]
            values.transpose(0, 1),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attended.transpose(0, 1)
    return out
