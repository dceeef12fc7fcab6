"""Timing a layer's LoRA work on a CUDA GPU: medians of CUDA-graph replays, with L2 flushed where a
kernel is timed alone, and the layer as the decoder calls it ("served").

Served: qkv and gate_up leave their delta to the next fused kernel (lora_linear_deferred), o and
down add theirs into the residual stream, so on the overlap path the whole update runs beside the
base GEMM; plus what reading the delta adds after qkv and gate_up (RoPE + KV write, or for a model
with q/k norms the separate add before them; SiLU·up), timed with and without.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.testing import do_bench_cudagraph

from kernels.fused import rope_and_cache_kv, silu_and_mul
from kernels.lora import LoRABatch, linear_deferred_with_plan, linear_with_plan
from kernels.lora.configs import Plan
from kernels.lora.tuning.layer import HEAD_DIM, Projection

RESIDUAL_PROJECTIONS = ("o", "down")  # their outputs are added to the residual stream next


def median_us(fn: Callable[[], object], rep_ms: int = 25) -> float:
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


class Flushed:
    """Median time of a function with L2 flushed before each call (the flush timed once, subtracted):
    in a model the previous layer's weights have evicted a kernel's operands. The flush reads
    (128 MiB): a write would leave L2 full of dirty lines for the timed call to write back."""

    def __init__(self) -> None:
        self.scratch = torch.ones(32 << 20, dtype=torch.float32, device="cuda")
        self.flush_us = median_us(self.scratch.sum, rep_ms=8)

    def __call__(self, fn: Callable[[], object]) -> float:
        def flush_and_run() -> None:
            self.scratch.sum()
            fn()

        return median_us(flush_and_run, rep_ms=8) - self.flush_us


def run_served(
    layer: list[Projection], xs: list[torch.Tensor], plans: list[Plan], batch: LoRABatch, residual: torch.Tensor
) -> None:
    """The layer as the decoder calls it, along `plans`: qkv and gate_up leave their delta to the next
    fused kernel (not run here), o and down add theirs into `residual` [T, hidden]."""
    for plan, p, x in zip(plans, layer, xs, strict=True):
        args = (plan, x, p.weight, None, p.lora_a, p.lora_b, batch)
        if p.name in RESIDUAL_PROJECTIONS:
            linear_with_plan(*args, residual=residual)
        else:
            linear_deferred_with_plan(*args)


def attention_heads(widths: tuple[int, ...], head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(q heads, kv heads) of a qkv projection with slice widths (q, k, v), heads of head_dim."""
    if len(widths) != 3 or widths[1] != widths[2] or any(w % head_dim for w in widths):
        raise ValueError(f"qkv widths {widths} are not (q, k, v) of whole {head_dim}-wide heads with k = v")
    return widths[0] // head_dim, widths[1] // head_dim


def delta_consumer(
    p: Projection, num_tokens: int, head_dim: int = HEAD_DIM
) -> Callable[[torch.Tensor | None], object] | None:
    """The fused kernel that reads p's deferred delta [T, sum N_i] (its argument; None: without one),
    on tensors of p's shapes: RoPE + KV-cache write after qkv, SiLU·up after gate_up; None for a
    projection whose delta is not deferred."""
    if p.name not in ("qkv", "gate_up"):
        return None
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    out = torch.randn(num_tokens, sum(p.widths), **bf16)
    if p.name == "gate_up":
        return lambda delta: silu_and_mul(out, delta)
    heads, kv_heads = attention_heads(p.widths, head_dim)
    cos, sin = torch.randn(num_tokens, head_dim, **bf16), torch.randn(num_tokens, head_dim, **bf16)
    caches = [torch.empty(-(-num_tokens // 16), 16, kv_heads, head_dim, **bf16) for _ in range(2)]
    slots = torch.arange(num_tokens, device="cuda")
    return lambda delta: rope_and_cache_kv(out, cos, sin, *caches, slots, heads, delta)


def delta_read_us(
    layer: list[Projection], num_tokens: int, *, qk_norm: bool = False, head_dim: int = HEAD_DIM
) -> dict[str, float]:
    """What reading a deferred LoRA delta adds after each deferred projection of the layer (us): its
    consumer (delta_consumer) timed with and without the delta; with qk_norm, the qkv delta's own add,
    which the decoder runs before the q/k norms (worker.model.layers.SelfAttention), RoPE then
    running without it."""
    added = {}
    for p in layer:
        if (consume := delta_consumer(p, num_tokens, head_dim)) is None:
            continue
        delta = torch.randn(num_tokens, sum(p.widths), device="cuda", dtype=torch.bfloat16)
        if p.name == "qkv" and qk_norm:
            added[p.name] = _add_us(delta)
        else:
            added[p.name] = max(0.0, _consume_us(consume, delta) - _consume_us(consume, None))
    return added


def _add_us(delta: torch.Tensor) -> float:
    out = torch.randn_like(delta)
    return median_us(lambda: out.add_(delta))


def _consume_us(consume: Callable[[torch.Tensor | None], object], delta: torch.Tensor | None) -> float:
    return median_us(lambda: consume(delta))


def served_us(
    layer: list[Projection],
    xs: list[torch.Tensor],
    plans: list[Plan],
    batch: LoRABatch,
    delta_reads: dict[str, float],
) -> float:
    """The served layer's time (us): run_served, plus the delta reads of the projections it defers."""
    hidden = {p.weight.shape[0] for p in layer if p.name in RESIDUAL_PROJECTIONS}
    if len(hidden) > 1:
        raise ValueError(f"residual projections of different widths {sorted(hidden)}")
    residual = torch.zeros(xs[0].shape[0], max(hidden, default=0), device="cuda", dtype=torch.bfloat16)
    deferred = sum(delta_reads.get(p.name, 0.0) for p, plan in zip(layer, plans, strict=True) if plan.path == "overlap")
    return median_us(lambda: run_served(layer, xs, plans, batch, residual)) + deferred
