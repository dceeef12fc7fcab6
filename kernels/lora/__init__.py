"""Multi-LoRA: many adapters applied per token inside one batch.

Semantics (reference.py is the oracle):
    for each token t with s = token_slots[t] >= 0, for each slice i (q|k|v, gate|up, ...):
        r = slot_ranks[s]
        y[t, col_i : col_i + N_i] += slot_scales[s] * (x[t] @ A_i[s, :r].T) @ B_i[s, :, :r].T

Weights are paged (S-LoRA's unified paging, tiles.py): lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]
hold P pages of PR rank rows, and the batch's page table slot_pages [S, pages_per_slot] assembles
A_i[s] [max_rank, K] and B_i[s] [N_i, max_rank] (max_rank = pages_per_slot * PR): rank row r of
slot s is row r % PR of page slot_pages[s, r // PR]. One page per slot of PR = max_rank rows with
slot_pages[s] = [s] is the unpaged layout.

The engine calls `lora_linear` (or `lora_linear_deferred`, where the next fused kernel adds the
delta) for every adapted projection. CPU tensors take the reference; CUDA
tensors take one of the Triton paths in paths.py ("fused", "split", "overlap"), chosen
per GPU model, projection shape and token count by configs.py (tuned by tuning/).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kernels.lora.configs import Plan, plan_for
from kernels.lora.metadata import LoRABatch
from kernels.lora.paths import add_lora_cuda, linear_deferred_with_plan, linear_with_plan
from kernels.lora.reference import add_lora_reference
from kernels.lora.tiles import rank_pad
from kernels.quant import Int4Weight, base_linear

__all__ = [
    "LoRABatch",
    "Plan",
    "add_lora",
    "linear_deferred_with_plan",
    "linear_with_plan",
    "lora_linear",
    "lora_linear_deferred",
    "plan_for_batch",
]


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def plan_for_batch(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], batch: LoRABatch
) -> Plan:
    """The path and launch configurations a CUDA batch x [T, K] takes for these slices (keyed by the
    padded max rank, pages_per_slot * PR, whatever the page size)."""
    widths = tuple(b.shape[1] for b in lora_b)
    max_rank = batch.pages_per_slot * lora_a[0].shape[1]
    return plan_for(_device_name(x.device.index or 0), x.shape[1], widths, rank_pad(max_rank), x.shape[0])


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> None:
    """y [T, sum N_i] += per-token LoRA of x [T, K], in place; lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]."""
    if not x.is_cuda:
        add_lora_reference(y, x, lora_a, lora_b, batch)
        return
    add_lora_cuda(plan_for_batch(x, lora_a, lora_b, batch), y, x, lora_a, lora_b, batch)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch | None,
    *,
    residual: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] @ weight[N, K].T (+ bias) plus each token's LoRA delta; slices stack along N
    (lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]). weight_scale float32 [N]: the weight is fp8
    with these per-channel scales (kernels/quant), and the delta is added on top of its GEMM; so
    it is on top of a 4-bit weight (an Int4Weight, kernels/quant).

    residual [T, N]: a tensor the caller adds the result to next (the residual stream). Where the
    path computes the delta beside the base GEMM (decode sizes on CUDA), it adds the delta into
    `residual` rather than into the result; the sum of the two is the same either way.
    """
    if batch is None:
        return base_linear(x, weight, bias, weight_scale)
    if not x.is_cuda:
        y = base_linear(x, weight, bias, weight_scale)
        add_lora_reference(y, x, lora_a, lora_b, batch)
        return y
    plan = plan_for_batch(x, lora_a, lora_b, batch)
    return linear_with_plan(plan, x, weight, bias, lora_a, lora_b, batch, residual=residual, weight_scale=weight_scale)


def lora_linear_deferred(
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch | None,
    *,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`lora_linear` for a caller whose next kernel adds the LoRA delta itself: (y, delta), both
    [T, N], with y + delta the projection. Where the path computes the delta beside the base GEMM
    (decode sizes on CUDA), y is the base projection and delta the LoRA delta; elsewhere delta is
    None and y is the whole projection."""
    if batch is None or not x.is_cuda:
        return lora_linear(x, weight, bias, lora_a, lora_b, batch, weight_scale=weight_scale), None
    plan = plan_for_batch(x, lora_a, lora_b, batch)
    return linear_deferred_with_plan(plan, x, weight, bias, lora_a, lora_b, batch, weight_scale=weight_scale)
