"""Checkpoint tensors into a projection's FP8 weight and its per-output-channel scales.

A plain checkpoint's weight is quantized on the device as it arrives (kernels/quant: one scale per
output row, so the packed slices of q/k/v or gate/up are quantized exactly as if they were separate);
a pre-quantized checkpoint's fp8 weight is copied as it is, and its scale (one per tensor, or one
per output channel) is spread over the slice's rows. A per-tensor scale spread over rows is the same
number in every row: nothing is re-quantized.
"""

from __future__ import annotations

import torch

from kernels.quant import FP8_DTYPE, quantize_weight
from worker.model.weights import copy_weight


def quantize_into(weight: torch.Tensor, scale: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """Quantize the checkpoint's floating-point `tensor` [N, K] into the fp8 `weight` [N, K] and its
    float32 `scale` [N] (slices of a packed layer's), on their device."""
    if tensor.dtype == FP8_DTYPE:
        raise ValueError(f"{name}: the checkpoint holds fp8 weights but its config.json has no quantization_config")
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, device=weight.device)
    copy_weight(staged, tensor, name=name)  # paced beside a serving model, like any weight
    quantized, scales = quantize_weight(staged)
    weight.copy_(quantized)
    scale.copy_(scales)


def copy_fp8(weight: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """Copy a pre-quantized checkpoint's fp8 `tensor` [N, K] into `weight` as it is."""
    if tensor.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: an FP8 checkpoint's weight must be {FP8_DTYPE}, not {tensor.dtype}")
    copy_weight(weight, tensor, name=name)


def copy_scale(scale: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """A pre-quantized checkpoint's weight scale (one value, or one per output channel: [N] or
    [N, 1]) into the float32 per-row `scale` [N]."""
    rows = scale.numel()
    if tensor.numel() != 1 and tuple(tensor.shape) not in ((rows,), (rows, 1)):
        raise ValueError(
            f"{name}: weight scale of shape {tuple(tensor.shape)} is neither per tensor nor per output channel "
            f"({rows} rows); block-wise scales are not supported"
        )
    scale.copy_(tensor.reshape(-1).to(torch.float32))  # a single value broadcasts over the rows
