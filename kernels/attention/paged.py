"""Paged causal attention over a flat batch as one Triton kernel, for prefill chunks and decodes alike.

One program owns (sequence, tile of BLOCK_Q new tokens, KV head): its query rows are the tile's
tokens × the GROUP query heads sharing that KV head (GQA), so every K/V tile loaded from the cache
serves GROUP heads at once. It walks the sequence's context in BLOCK_N-position tiles, gathering
each position's cache slot from the block table (any block size), with an online softmax:

    for each new token j of sequence s at position p = ctx - q_len + j, each head h:
        out[j, h] = softmax(q[j, h] · K[0..p]ᵀ * scale) · V[0..p]        K, V read via block_tables[s]

Decode is the q_len = 1 case (BLOCK_Q = 1); chunked prefill attends over cached context + itself.
An fp8 cache's K scale of the program's KV head goes into the score scale and its V scale into the
final division by the softmax sum: two multiplies per program, none per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention.reference import check_kv_scales, check_out
from kernels.quant.reference import FP8_DTYPE

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    block_tables_ptr,  # int32 [B, max_blocks_per_seq]
    query_start_loc_ptr,  # int32 [B + 1]
    context_lens_ptr,  # int32 [B]
    kv_scales_ptr,  # float32 [2, H_kv]: K's then V's per-head scales, read when CACHE_FP8
    qk_scale,  # softmax scale × log2(e): the kernel exponentiates in base 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    BLOCK_N: tl.constexpr,  # context positions per iteration
    CACHE_BLOCK: tl.constexpr,  # tokens per cache block
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dots (no tf32), so fp32 runs match the reference
    CACHE_FP8: tl.constexpr,  # the caches hold K / V divided by their head's scales
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    query_pos = context_len - q_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    q_offsets = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    if CACHE_FP8:  # q · (K8 * k_scale) = (q · K8) * k_scale: one multiply per score, folded into qk_scale
        qk_scale = qk_scale * tl.load(kv_scales_ptr + kv_head)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the tile's last token sees the furthest: nothing past its position is read
    kv_end = context_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // CACHE_BLOCK, mask=pos_valid, other=0)
        block = block.to(tl.int64)  # block * stride_kb passes 2**31 elements in a large cache
        in_block = pos % CACHE_BLOCK
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k_offsets = block[:, None] * stride_kb + in_block[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        # [BLOCK_N, BLOCK_D], an fp8 cache widened to q's dtype (exactly)
        k = tl.load(k_cache_ptr + k_offsets, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        v_offsets = block[:, None] * stride_vb + in_block[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_offsets, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
        visible = (pos[None, :] <= query_pos[:, None]) & pos_valid[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))  # [BLOCK_M, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see nothing: keep them finite
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    norm = tl.where(l_i == 0.0, 1.0, l_i)  # [BLOCK_M] fp32
    if CACHE_FP8:  # P · (V8 * v_scale) = (P · V8) * v_scale
        norm = norm / tl.load(kv_scales_ptr + num_kv_heads + kv_head)
    out = acc / norm[:, None]
    o_offsets = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def paged_attention_triton(
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
    """out [T, H, D] for q [T, H, D] over K/V already in the cache; same semantics as the reference.
    Written into `out` [T, H, D] when given (any strides but a contiguous last axis).

    key_cache / value_cache [num_blocks, block_size, H_kv, D] (H a multiple of H_kv); kv_scales
    float32 [2, H_kv]: an fp8 cache's K and V scales, required with one (check_kv_scales);
    query_start_loc int32 [B + 1]; context_lens int32 [B]; block_tables int32 [B, max_blocks_per_seq];
    max_query_len: the longest q_len in the batch, known on the host (sizes the grid, no device sync).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    num_seqs = context_lens.shape[0]
    if value_cache.shape != key_cache.shape or cache_dim != head_dim:
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not fit q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.dtype not in (q.dtype, FP8_DTYPE) or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"the caches {key_cache.dtype} / {value_cache.dtype} must both be q's {q.dtype} or fp8")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc must be [B + 1] and block_tables [B, ...] for context_lens [B]")
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("context_lens", context_lens),
        ("block_tables", block_tables),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if q.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables must be contiguous along their last axis")
    kv_scales = check_kv_scales(kv_scales, key_cache)
    out = torch.empty_like(q) if out is None else check_out(out, q)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    # decode: one token per sequence; prefill: enough tokens that a tile fills the matrix units
    block_q = 1 if max_query_len == 1 else max(1, 64 // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_n = 64 if max_query_len == 1 else 32
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        key_cache if kv_scales is None else kv_scales,  # never read without CACHE_FP8
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CACHE_BLOCK=block_size,
        IEEE=q.dtype == torch.float32,
        CACHE_FP8=kv_scales is not None,
        **pdl.launch_options(q.device, num_tokens),
        num_warps=4,
    )
    return out
