"""Multi-LoRA: many adapters applied per token inside one batch.

Semantics (reference.py is the oracle):
    for each token t with s = token_slots[t] >= 0, for each slice i (q|k|v, gate|up, ...):
        r = slot_ranks[s]
        y[t, col_i : col_i + N_i] += slot_scales[s] * (x[t] @ A_i[s, :r].T) @ B_i[s, :, :r].T

The engine calls `lora_linear` for every adapted projection. CPU tensors take the reference; CUDA
tensors take one of three Triton paths, chosen per GPU model, projection shape and token count by
configs.py (tuned by bench/tune_lora.py):
    fused     one kernel computes bias + delta into y (z stays on-chip), then the base GEMM adds
              x · Wᵀ into it in cuBLAS's epilogue (addmm_, beta = 1): decode-sized batches
    split     shrink (split-K) writes z, expand writes bias + delta, then the same addmm_
    epilogue  shrink writes z, then one Triton GEMM computes x · Wᵀ and adds the delta in its epilogue
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.lora.configs import Plan, plan_for
from kernels.lora.expand import lora_expand
from kernels.lora.fused import lora_fused
from kernels.lora.linear import linear_lora
from kernels.lora.metadata import LoRABatch
from kernels.lora.reference import add_lora_reference
from kernels.lora.shrink import lora_shrink
from kernels.lora.tiles import check_slices, rank_pad, slice_groups

__all__ = ["LoRABatch", "Plan", "add_lora", "linear_with_plan", "lora_linear", "plan_for_batch"]


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def plan_for_batch(x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]) -> Plan:
    """The path and launch configurations a CUDA batch x [T, K] takes for these slices."""
    widths = tuple(b.shape[1] for b in lora_b)
    return plan_for(_device_name(x.device.index or 0), x.shape[1], widths, rank_pad(lora_a[0].shape[1]), x.shape[0])


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> None:
    """y [T, sum N_i] += per-token LoRA of x [T, K], in place; lora_a[i] [S, R, K], lora_b[i] [S, N_i, R]."""
    if not x.is_cuda:
        add_lora_reference(y, x, lora_a, lora_b, batch)
        return
    _, width = check_slices(x, lora_a, lora_b, batch.num_slots)
    if y.shape != (x.shape[0], width):
        raise ValueError(f"y {tuple(y.shape)} must be [T={x.shape[0]}, sum N_i={width}]")
    plan = plan_for_batch(x, lora_a, lora_b)
    for group in slice_groups(lora_a, lora_b):
        if plan.path == "fused":
            lora_fused(y, x, group, batch, plan.fused)
        else:
            lora_expand(y, lora_shrink(x, group, batch, plan.shrink), group, batch, plan.expand)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch | None,
) -> torch.Tensor:
    """x [T, K] @ weight[N, K].T (+ bias) plus each token's LoRA delta; slices stack along N."""
    if batch is None:
        return F.linear(x, weight, bias)
    if not x.is_cuda:
        y = F.linear(x, weight, bias)
        add_lora_reference(y, x, lora_a, lora_b, batch)
        return y
    return linear_with_plan(plan_for_batch(x, lora_a, lora_b), x, weight, bias, lora_a, lora_b, batch)


def linear_with_plan(
    plan: Plan,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> torch.Tensor:
    """`lora_linear` on CUDA along the given plan (the benchmark and tuner force each path here)."""
    _, width = check_slices(x, lora_a, lora_b, batch.num_slots)
    if weight.shape != (width, x.shape[1]):
        raise ValueError(f"weight {tuple(weight.shape)} must be [sum N_i={width}, K={x.shape[1]}]")
    groups = slice_groups(lora_a, lora_b)
    if plan.path == "epilogue" and len(groups) == 1:
        return linear_lora(
            x, weight, bias, lora_shrink(x, groups[0], batch, plan.shrink), groups[0], batch, plan.linear
        )
    # y = bias + delta for every row, then the base GEMM accumulates onto it (no separate pass over y)
    y = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    for group in groups:
        if plan.path == "fused":
            lora_fused(y, x, group, batch, plan.fused, bias=bias, accumulate=False)
        else:
            z = lora_shrink(x, group, batch, plan.shrink)
            lora_expand(y, z, group, batch, plan.expand, bias=bias, accumulate=False)
    return y.addmm_(x, weight.t())
