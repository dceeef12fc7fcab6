"""Torch references of the fused decoder-layer ops: the exact arithmetic of the HF Llama modules,
rounding to the activation dtype where HF rounds (the Triton kernels round at the same points)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import store_kv


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] normalised in float32, cast back before the weight [hidden] (as HF does, so
    low-precision checkpoints round the same way)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, hidden]; the sum is rounded to
    the dtype before it is normalised, as HF's `hidden = residual + hidden` then norm does."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def silu_and_mul_reference(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2I] (gate columns, then up columns), plus delta [T, 2I] when given (rounded to the dtype,
    as HF adds a LoRA's output) → silu(gate) * up [T, I]."""
    if delta is not None:
        gate_up = gate_up + delta
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim] (HF "rotate half" layout: dimension i
    pairs with i + head_dim/2; cos/sin hold each pair's angle twice)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def rope_and_cache_kv_reference(
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
    """Rotate the q heads of qkv [T, (H + 2 H_kv) * D] in place and write rotated k and v into the
    caches [num_blocks, block_size, H_kv, D] at int64 flat slots [T]; with delta [T, (H + 2 H_kv) * D]
    (a LoRA delta), qkv + delta is what is rotated and cached. fp8 caches take each value over its
    head's scale in kv_scales float32 [2, H_kv] (K's, V's; store_kv). Returns q, a [T, H, D] view of qkv."""
    if delta is not None:
        qkv.add_(delta)
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2:]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    q.copy_(apply_rope_reference(q, cos, sin))
    k = apply_rope_reference(k.view(num_tokens, num_kv_heads, head_dim), cos, sin)
    store_kv(k, v.view(num_tokens, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping, kv_scales)
    return q
