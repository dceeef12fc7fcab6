"""The decoder layer's small ops fused into one kernel each: residual add + RMSNorm, SiLU(gate)·up,
and RoPE of q and k together with the KV-cache write.

Unfused, each is several elementwise torch kernels whose launches and extra passes over the
activations cost more than the work (what they cost a decode step: docs/benchmarks.md, "Engine").
CUDA tensors take the Triton kernels; anything else takes the torch references (reference.py),
which are also the kernels' oracle.
"""

from __future__ import annotations

import torch

from kernels.fused.activation import silu_and_mul_triton
from kernels.fused.norm import rms_norm_triton
from kernels.fused.reference import (
    add_rms_norm_reference,
    rms_norm_reference,
    rope_and_cache_kv_reference,
    silu_and_mul_reference,
)
from kernels.fused.rope import rope_and_cache_kv_triton

__all__ = ["add_rms_norm", "rms_norm", "rope_and_cache_kv", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] → weight * normalised x [T, hidden]."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, hidden]. On CUDA the sum is written
    into `residual` itself (the returned one is the same tensor): callers must own it."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual), residual
    return add_rms_norm_reference(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2I] (gate columns, then up columns) → silu(gate) * up [T, I]; with delta [T, 2I] (a LoRA
    delta computed beside the gate_up projection) of gate_up + delta."""
    if gate_up.is_cuda:
        return silu_and_mul_triton(gate_up, delta)
    return silu_and_mul_reference(gate_up, delta)


def rope_and_cache_kv(
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
    """Rotate q (in place in qkv [T, (H + 2 H_kv) * D]) and k by cos/sin [T, D], and write k and v
    into the caches [num_blocks, block_size, H_kv, D] at int64 flat slots [T]; with delta (a LoRA
    delta computed beside the qkv projection, qkv's shape), of qkv + delta. fp8 caches take each
    value over its head's scale (kv_scales float32 [2, H_kv]: K's, V's). Returns q [T, H, D]."""
    rope = rope_and_cache_kv_triton if qkv.is_cuda else rope_and_cache_kv_reference
    return rope(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, delta, kv_scales)
