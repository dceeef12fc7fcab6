"""Checkpoint tensors into a projection's FP8 weight and its per-output-channel scales.

A plain checkpoint's weight is quantized on the device as it arrives (kernels/quant: one scale per
output row, so the packed slices of q/k/v or gate/up are quantized exactly as if they were separate);
a pre-quantized checkpoint's fp8 weight is copied as it is, and its scale (one per tensor, or one
per output channel) is spread over the slice's rows. A per-tensor scale spread over rows is the same
number in every row: nothing is re-quantized. A block-wise checkpoint's weight (one scale per block
of outputs × inputs) is the exception: BlockScaledFP8 dequantizes it with its blocks' scales and
quantizes it again per row, as a plain checkpoint's weight.
"""

from __future__ import annotations

import torch

from kernels.quant import FP8_DTYPE, quantize_weight
from kernels.quant.reference import check_block_scales, dequantize_blocks
from worker.model.parallel.sharding import Split
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
            f"({rows} rows); block-wise scales are read only where the checkpoint's config says so"
        )
    scale.copy_(tensor.reshape(-1).to(torch.float32))  # a single value broadcasts over the rows


# rows of a block-wise weight dequantized and quantized again at once (rounded down to whole blocks)
_ROWS_AT_ONCE = 1024


class BlockScaledFP8:
    """One projection slice of a block-wise FP8 checkpoint: its fp8 weight [N, K] and its scales, one
    per block of `block` = (outputs, inputs), [ceil(N / outputs), ceil(K / inputs)], into the served
    fp8 `weight` and its float32 per-row `scale`. The kernels take one scale per output channel, so
    the weight is dequantized on the device (float32) and quantized again per row: each weight
    rounded once more onto e4m3, at a precision relative to its row's largest weight instead of its
    block's. The two checkpoint tensors arrive in either order (`load_weight`, `load_scales`); the
    second completes the slice. Under tensor parallelism (`split`) the whole weight is quantized and
    the rank keeps its part, so every rank serves the one-process weights (a block need not lie in
    one rank's part)."""

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], *, name: str, split: Split | None
    ) -> None:
        self.weight, self.scale, self.block, self.name, self.split = weight, scale, block, name, split
        self._codes: torch.Tensor | None = None
        self._block_scales: torch.Tensor | None = None

    def load_weight(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != FP8_DTYPE:
            raise ValueError(f"{self.name}.weight: an FP8 checkpoint's weight must be {FP8_DTYPE}, not {tensor.dtype}")
        self._codes = torch.empty(tensor.shape, dtype=FP8_DTYPE, device=self.weight.device)
        copy_weight(self._codes, tensor, name=f"{self.name}.weight")
        self._finish_when_complete()

    def load_scales(self, tensor: torch.Tensor) -> None:
        if tensor.dim() != 2:
            raise ValueError(
                f"{self.name}.weight_scale: a block-wise checkpoint's scales are [N blocks, K blocks], "
                f"not of shape {tuple(tensor.shape)}"
            )
        self._block_scales = tensor.to(self.weight.device, torch.float32)
        self._finish_when_complete()

    def _finish_when_complete(self) -> None:
        if self._codes is None or self._block_scales is None:
            return
        try:
            check_block_scales(tuple(self._codes.shape), tuple(self._block_scales.shape), self.block)
        except ValueError as exc:
            raise ValueError(f"{self.name}.weight_scale: {exc}") from None
        codes, scales = torch.empty_like(self._codes), torch.empty(len(self._codes), device=self._codes.device)
        # a few block rows at a time: rows quantize independently, and float32 copies of the whole
        # weight would be 4 bytes a weight beside a model being served
        block_rows = self.block[0]
        step = block_rows * max(1, _ROWS_AT_ONCE // block_rows)
        for start in range(0, len(self._codes), step):
            rows = slice(start, start + step)
            blocks = self._block_scales[start // block_rows : -(-min(start + step, len(self._codes)) // block_rows)]
            codes[rows], scales[rows] = quantize_weight(dequantize_blocks(self._codes[rows], blocks, self.block))
        if self.split is not None:
            codes, scales = self.split.take(codes), self.split.take_vector(scales)
        if codes.shape != self.weight.shape:
            shapes = f"checkpoint shape {tuple(codes.shape)} != model shape {tuple(self.weight.shape)}"
            raise ValueError(f"{self.name}.weight: {shapes}")
        self.weight.copy_(codes)
        self.scale.copy_(scales)
        self._codes = self._block_scales = None
