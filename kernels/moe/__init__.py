"""Mixture-of-experts layers with per-token multi-LoRA on every expert.

Semantics (reference.py is the oracle):
    w, e = top_k(softmax(x @ router.T))  (renormalised if the family does)
    out[t] = sum_k w[t, k] * Expert_e(x[t]) with Expert_e(x) = down_e(silu(gate_e(x)) * up_e(x)),
    each of gate_up and down carrying token t's adapter delta (if it has one) for expert e.

`route` and `moe_forward` dispatch: CPU tensors take the torch reference, CUDA tensors the Triton
kernels (routing.py, align.py with align_small.py / align_large.py, gemm.py, lora_shrink.py,
lora_expand.py, topk_sum.py, composed in fused.py, the LoRA kernels on a side stream beside the grouped
GEMMs) with launch configurations from configs.py (tuned by bench/tune_moe.py). FP8 experts (W8A16)
are widened in the grouped GEMM's registers; their adapters stay in x's dtype.
"""

from __future__ import annotations

import torch

from kernels.moe.fused import moe_triton
from kernels.moe.reference import ExpertLoRA, moe_reference, route_reference
from kernels.moe.routing import topk_softmax

__all__ = ["ExpertLoRA", "moe_forward", "route"]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights float32 [T, top_k], expert ids int32 [T, top_k])."""
    if not logits.is_cuda:
        return route_reference(logits, top_k, renormalize)
    return topk_softmax(logits, top_k, renormalize)


def moe_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    lora: ExpertLoRA | None = None,
    token_slots: torch.Tensor | None = None,
    slot_scales: torch.Tensor | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] → [T, H]; see reference.moe_reference for the arguments (fp8 experts: w13 and w2 in
    fp8 with their per-output-channel scales)."""
    forward = moe_triton if x.is_cuda else moe_reference
    return forward(x, weights, ids, w13, w2, lora, token_slots, slot_scales, w13_scale=w13_scale, w2_scale=w2_scale)
