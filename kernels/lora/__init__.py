"""Multi-LoRA: many adapters applied per token inside one batch.

The engine calls `lora_linear` for every adapted projection; what runs underneath (reference,
separate shrink/expand kernels, fused paths) is this package's choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.lora.metadata import LoRABatch
from kernels.lora.reference import add_lora_reference

__all__ = ["LoRABatch", "add_lora", "lora_linear"]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> None:
    """y [T, sum N_i] += per-token LoRA of x [T, K], in place (see reference.py for the math)."""
    add_lora_reference(y, x, lora_a, lora_b, batch)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch | None,
) -> torch.Tensor:
    """x [T, K] @ weight[N, K].T (+ bias) plus each token's LoRA delta; slices stack along N."""
    y = F.linear(x, weight, bias)
    if batch is not None:
        add_lora(y, x, lora_a, lora_b, batch)
    return y
