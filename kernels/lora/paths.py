"""The CUDA side of `lora_linear` and `add_lora`: one function per path (configs.py names them).

Semantics (see reference.py; lora_a[i] [P, PR, K] and lora_b[i] [P, N_i, PR] are pages read through
the batch's page table, see tiles.py):
    lora_linear: y = x · Wᵀ (+ bias) + per-token LoRA delta (W fp8 with per-channel scales when a
                 weight_scale is given, or a 4-bit Int4Weight: kernels/quant);
    add_lora:    y += per-token LoRA delta

    fused     fused.py writes y = bias + delta (z stays on-chip), then y.addmm_(x, Wᵀ): the base
              GEMM adds x · Wᵀ in cuBLAS's epilogue (beta = 1) instead of a separate pass over y
    split     shrink.py writes z, expand writes y = bias + delta, then the same addmm_
    overlap   shrink.py runs on a second stream while the base GEMM runs; expand then adds into y

A caller that adds the delta itself (`linear_deferred_with_plan`, or `residual=` for a sum the
caller takes next) moves the overlap path's expand onto the second stream too: the whole LoRA
update then runs beside the base GEMM, and no LoRA kernel is left on the critical path at decode.
Beside the short GEMMs of a quantized base at decode (a 4-bit weight's tinygemm, kernels/quant/int4_mma.py;
an fp8 weight's W8A16 at up to single_launch.MAX_TOKENS tokens) that update is one launch
(single_launch.py): two dependent launches outlast the GEMM there, while beside the longer bf16
GEMMs they are hidden, and one launch's waiting programs measured slower beside a GEMM that fills
the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora.configs import Plan, SingleLaunchConfig
from kernels.lora.expand import lora_expand
from kernels.lora.expand_gather import lora_expand_gather
from kernels.lora.fused import lora_fused
from kernels.lora.metadata import LoRABatch
from kernels.lora.shrink import lora_shrink
from kernels.lora.single_launch import MAX_TOKENS as SINGLE_LAUNCH_MAX_TOKENS
from kernels.lora.single_launch import lora_single_launch
from kernels.lora.tiles import SliceGroup, check_slices, slice_groups
from kernels.quant import Int4Weight, base_linear, fp8_linear, int4_linear, takes_tinygemm
from kernels.streams import beside, join


def expand_with_plan(
    plan: Plan,
    y: torch.Tensor,
    z: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    bias: torch.Tensor | None = None,
    accumulate: bool = True,
) -> None:
    """The plan's expand of z (lora_shrink's partials) into y: the gathering kernel where the plan names
    one, else the grouped one (expand.py)."""
    if plan.gather is not None:
        lora_expand_gather(y, z, group, batch, plan.gather, bias=bias, accumulate=accumulate)
    else:
        lora_expand(y, z, group, batch, plan.expand, bias=bias, accumulate=accumulate)


def add_lora_cuda(
    plan: Plan,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> None:
    """y [T, sum N_i] += LoRA(x [T, K]) in place (lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]); with
    no base GEMM to hide behind, every path but "fused" is shrink then expand."""
    _, width = check_slices(x, lora_a, lora_b, batch)
    if y.shape != (x.shape[0], width):
        raise ValueError(f"y {tuple(y.shape)} must be [T={x.shape[0]}, sum N_i={width}]")
    for group in slice_groups(lora_a, lora_b):
        if plan.path == "fused":
            lora_fused(y, x, group, batch, plan.fused)
        else:
            expand_with_plan(plan, y, lora_shrink(x, group, batch, plan.shrink), group, batch)


def linear_with_plan(
    plan: Plan,
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    residual: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`lora_linear` on CUDA along the given plan (the benchmark and tuner force each path here):
    x [T, K], weight [sum N_i, K], bias [sum N_i] or None, lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]
    → y [T, sum N_i]. `residual` [T, sum N_i]: a tensor the caller adds y to next; the overlap path
    adds the delta into it, beside the base GEMM, instead of into y."""
    width = _check_weight(x, weight, lora_a, lora_b, batch)
    groups = slice_groups(lora_a, lora_b)
    if plan.path == "overlap" and residual is not None:
        if residual.shape != (x.shape[0], width) or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be y's shape and dtype")
        return _beside(plan, x, weight, bias, groups, batch, residual, weight_scale)[0]
    if plan.path == "overlap":
        return _overlap(plan, x, weight, bias, groups, batch, weight_scale)
    # "fused" and "split": y = bias + delta for every row, then the base GEMM accumulates onto it
    y = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    for group in groups:
        if plan.path == "fused":
            lora_fused(y, x, group, batch, plan.fused, bias=bias, accumulate=False)
        else:
            z = lora_shrink(x, group, batch, plan.shrink)
            expand_with_plan(plan, y, z, group, batch, bias=bias, accumulate=False)
    if isinstance(weight, Int4Weight):
        return y.add_(int4_linear(x, weight))  # the W4A16 GEMM takes no addend either
    if weight_scale is None:
        return y.addmm_(x, weight.t())
    return y.add_(fp8_linear(x, weight, weight_scale))  # no fp8 GEMM takes an addend: one more pass


def linear_deferred_with_plan(
    plan: Plan,
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`lora_linear_deferred` on CUDA along the given plan: (y, delta), both [T, sum N_i]. On the
    overlap path y = x · Wᵀ (+ bias) and delta is the LoRA delta, computed beside the base GEMM, for
    the consumer to add; on the others the delta is in y and delta is None."""
    if plan.path != "overlap":
        return linear_with_plan(plan, x, weight, bias, lora_a, lora_b, batch, weight_scale=weight_scale), None
    _check_weight(x, weight, lora_a, lora_b, batch)
    return _beside(plan, x, weight, bias, slice_groups(lora_a, lora_b), batch, None, weight_scale)


def _check_weight(
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> int:
    """The total output width, after checking the slices and the weight [sum N_i, K] against x [T, K]."""
    _, width = check_slices(x, lora_a, lora_b, batch)
    if weight.shape != (width, x.shape[1]):
        raise ValueError(f"weight {tuple(weight.shape)} must be [sum N_i={width}, K={x.shape[1]}]")
    return width


def _beside(
    plan: Plan,
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    groups: list[SliceGroup],
    batch: LoRABatch,
    target: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shrink and expand on the side stream while the base GEMM runs: the expand adds into `target`
    or, when it is None, writes a new delta tensor. Returns (y, the tensor holding the delta)."""
    # allocated on the current stream, where its consumer runs and frees it after the join
    delta = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device) if target is None else target
    accumulate = target is not None
    with beside(x.device):  # after x, the target and the batch metadata
        for group in groups:
            if _single_launch_beside(weight, weight_scale, x.shape[0]):
                single = plan.single or SingleLaunchConfig()
                lora_single_launch(delta, x, group, batch, single, accumulate=accumulate)
            else:
                z = lora_shrink(x, group, batch, plan.shrink)
                expand_with_plan(plan, delta, z, group, batch, accumulate=accumulate)
    y = base_linear(x, weight, bias, weight_scale)
    join(x.device)
    return y, delta


def _single_launch_beside(
    weight: torch.Tensor | Int4Weight, weight_scale: torch.Tensor | None, num_tokens: int
) -> bool:
    """Whether the LoRA work beside this base GEMM runs as one launch (single_launch.py): beside the
    short GEMMs where two dependent launches were measured to outlast the GEMM (docs/benchmarks.md,
    "single launch"), a 4-bit weight's tinygemm steps and an fp8 weight's W8A16 steps of at most
    single_launch.MAX_TOKENS tokens. Beside bf16 GEMMs, and at 8 tokens of a 4-bit weight (the k-major
    kernel on every SM), two launches were faster."""
    if isinstance(weight, Int4Weight):
        return takes_tinygemm(weight, num_tokens)
    return weight_scale is not None and num_tokens <= SINGLE_LAUNCH_MAX_TOKENS


def _overlap(
    plan: Plan,
    x: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    groups: list[SliceGroup],
    batch: LoRABatch,
    weight_scale: torch.Tensor | None,
) -> torch.Tensor:
    with beside(x.device):  # after x and the batch metadata
        zs = [lora_shrink(x, group, batch, plan.shrink) for group in groups]
    y = base_linear(x, weight, bias, weight_scale)
    join(x.device, *zs)
    for group, z in zip(groups, zs, strict=True):
        expand_with_plan(plan, y, z, group, batch)
    return y
