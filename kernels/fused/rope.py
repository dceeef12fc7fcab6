"""Rotary embedding of q and k plus the KV-cache write, as one Triton kernel over the packed qkv
projection output (HF "rotate half" layout: dimension i pairs with i + D/2).

    qkv here is qkv + delta (rounded to the dtype) when a LoRA delta computed beside the projection
    is given; for each token t, with c, s = cos[t], sin[t] (the step's angles, in the dtype) and
    p = slot_mapping[t]:
        q heads:   qkv[t, q_h] = rotate(q_h)                      in place
        k heads:   key_cache[p, h]   = rotate(k_h)
        v heads:   value_cache[p, h] = v_h
    rotate(x) = x * c + rotate_half(x) * s, each product and the sum rounded to the dtype as torch does
    An fp8 cache (--kv-cache-dtype fp8) takes each cached value divided (in fp32) by its head's scale
    (kv_scales [2, H_kv]: K's, V's), rounded to nearest e4m3, saturating.

Grid: (tokens, H + 2 H_kv); each program moves one head of one token. k is never written back to
qkv: attention reads keys from the cache only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention.reference import check_kv_scales
from kernels.quant.per_token import saturate_to_e4m3
from kernels.quant.reference import FP8_DTYPE


@triton.jit
def _for_cache(x, scale_ptr, CACHE_FP8: tl.constexpr):
    """x as the cache stores it: itself, or (fp8 cache) divided by the head's scale at scale_ptr in
    fp32, saturated and rounded to e4m3."""
    if CACHE_FP8:  # a compile-time branch: one return, so its two types never meet
        x = saturate_to_e4m3(x.to(tl.float32) / tl.load(scale_ptr))
    return x


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr,  # [T, (H + 2 H_kv) * D]
    delta_ptr,  # [T, (H + 2 H_kv) * D], read when HAS_DELTA
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D]
    key_cache_ptr,  # [num_blocks, block_size, H_kv, D], contiguous
    value_cache_ptr,  # [num_blocks, block_size, H_kv, D], contiguous
    slot_mapping_ptr,  # int64 [T]
    kv_scales_ptr,  # float32 [2, H_kv]: K's then V's per-head scales, read when CACHE_FP8
    num_heads,
    num_kv_heads,
    stride_qkv,
    stride_delta,
    stride_cos,
    stride_sin,
    HAS_DELTA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    CACHE_FP8: tl.constexpr,  # the caches are fp8: values are saturated and rounded before the store
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM + d
    first = tl.load(src, mask=d_ok, other=0.0)
    second = tl.load(src + HALF, mask=d_ok, other=0.0)
    if HAS_DELTA:
        delta_src = delta_ptr + token * stride_delta + head * HEAD_DIM + d
        first = (first.to(tl.float32) + tl.load(delta_src, mask=d_ok, other=0.0).to(tl.float32)).to(dtype)
        second = (second.to(tl.float32) + tl.load(delta_src + HALF, mask=d_ok, other=0.0).to(tl.float32)).to(dtype)
    if head >= num_heads + num_kv_heads:  # v: copied into the cache as it is
        slot = tl.load(slot_mapping_ptr + token)
        kv_head = head - num_heads - num_kv_heads
        dst = value_cache_ptr + (slot * num_kv_heads + kv_head) * HEAD_DIM + d
        scale_ptr = kv_scales_ptr + num_kv_heads + kv_head
        tl.store(dst, _for_cache(first, scale_ptr, CACHE_FP8).to(value_cache_ptr.dtype.element_ty), mask=d_ok)
        tl.store(dst + HALF, _for_cache(second, scale_ptr, CACHE_FP8).to(value_cache_ptr.dtype.element_ty), mask=d_ok)
    else:
        cos = tl.load(cos_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
        x1 = first.to(tl.float32)
        x2 = second.to(tl.float32)
        out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
        if head < num_heads:
            tl.store(src, out1, mask=d_ok)
            tl.store(src + HALF, out2, mask=d_ok)
        else:
            slot = tl.load(slot_mapping_ptr + token)
            dst = key_cache_ptr + (slot * num_kv_heads + head - num_heads) * HEAD_DIM + d
            scale_ptr = kv_scales_ptr + head - num_heads
            tl.store(dst, _for_cache(out1, scale_ptr, CACHE_FP8).to(key_cache_ptr.dtype.element_ty), mask=d_ok)
            tl.store(dst + HALF, _for_cache(out2, scale_ptr, CACHE_FP8).to(key_cache_ptr.dtype.element_ty), mask=d_ok)


def rope_and_cache_kv_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    delta: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.rope_and_cache_kv_reference: rotates q (+ delta) in place in qkv,
    writes rotated k and v (+ delta) at slot_mapping, into fp8 caches divided by kv_scales (float32
    [2, H_kv], required with them). Returns q, a [T, H, D] view of qkv."""
    num_tokens, width = qkv.shape
    num_kv_heads, head_dim = key_cache.shape[2:]
    if head_dim % 2 or width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"rope_and_cache_kv: qkv {tuple(qkv.shape)} is not [T, (H + 2 H_kv) * {head_dim}]")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.dtype not in (qkv.dtype, FP8_DTYPE):
        raise ValueError("rope_and_cache_kv: the caches must be contiguous and of qkv's dtype or fp8")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError("rope_and_cache_kv: the key and value caches must share a dtype")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"rope_and_cache_kv: cos/sin {tuple(cos.shape)} are not [{num_tokens}, {head_dim}]")
    if delta is not None and (delta.shape != qkv.shape or delta.stride(1) != 1 or delta.dtype != qkv.dtype):
        raise ValueError(f"rope_and_cache_kv: delta {tuple(delta.shape)} {delta.dtype} does not match qkv")
    kv_scales = check_kv_scales(kv_scales, key_cache)
    if num_tokens:
        _rope_and_cache_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv,
            qkv if delta is None else delta,
            cos,
            sin,
            key_cache,
            value_cache,
            slot_mapping,
            key_cache if kv_scales is None else kv_scales,  # never read without CACHE_FP8
            num_heads,
            num_kv_heads,
            qkv.stride(0),
            qkv.stride(0) if delta is None else delta.stride(0),
            cos.stride(0),
            sin.stride(0),
            HAS_DELTA=delta is not None,
            HEAD_DIM=head_dim,
            HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2),
            CACHE_FP8=kv_scales is not None,
            **pdl.launch_options(qkv.device, num_tokens),
            num_warps=1,
        )
    return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
