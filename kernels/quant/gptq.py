"""GPTQ (Frantar et al., 2022): weights rounded with second-order error feedback, onto the 4-bit grid
--quantization int4 uses (int4_reference.py: asymmetric, float16 scales, integer zero points) or onto
FP8 e4m3 with one scale per output channel (reference.py, what --quantization fp8 uses).

Round to nearest rounds each weight alone. GPTQ rounds one input column at a time and moves what the
rounding lost onto the columns not yet rounded, weighted by the inverse Hessian of the layer's
squared output error on calibration inputs X [T, K]: H = X.T @ X. The error it minimises is the
layer's output error ||X @ (W - Q).T||², not the weights', so directions the inputs never take
absorb the error of those they do.

- Columns go in "act order": the inputs of largest diag(H) first, while most columns are left to
  absorb their error (on the demo model it halved GPTQ's 4-bit perplexity cost over columns in
  order: docs/benchmarks.md, "GPTQ").
- With columns out of order a group's columns are rounded at different times, so every grid (a
  4-bit group's scale and zero point, an FP8 row's scale) is set before any rounding, from the
  weight as it is ("static groups"). Codes are stored in the weight's own column order, and a 4-bit
  input's group is k // G: the checkpoint is the plain (desc_act false) GPTQ format, which every
  GPTQ reader serves without a permutation.
- Columns are taken in blocks of BLOCK: inside a block each column's error updates the block's
  remaining columns at once; the columns after the block get the block's errors in one GEMM ("lazy
  batch updates"), which keeps the algorithm at GEMM speed on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.quant.int4_reference import GPTQ_ZERO_OFFSET, Int4Weight, affine_grid, affine_int4, round_to_grid
from kernels.quant.reference import FP8_DTYPE, quantize_rows, rowwise_scales

# H += DAMP * mean(diag(H)) * I: the GPTQ paper's 1%, keeping the Cholesky factorisation defined
# where calibration inputs are (nearly) collinear
DAMP = 0.01
# columns per lazy-update block
BLOCK = 128
# (a column's values float32 [N], its index k) → those values rounded onto the target grid, float32 [N]
ColumnRounding = Callable[[torch.Tensor, int], torch.Tensor]


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> tuple[torch.Tensor, Int4Weight]:
    """(4-bit levels int32 [K, N], the packed Int4Weight) of weight [N, K] quantized by GPTQ in groups
    of `group_size` inputs, against the calibration inputs' `hessian` [K, K] (X.T @ X, any positive
    multiple). Every zero point is GPTQ_ZERO_OFFSET or more, so a GPTQ checkpoint can hold the
    weight. Runs in float32 on the weight's device."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of the group size {group_size}")
    grid_scales, grid_zeros = affine_grid(
        weight.float().reshape(n, k // group_size, group_size), min_zero=GPTQ_ZERO_OFFSET
    )
    scales, zeros = grid_scales[..., 0], grid_zeros[..., 0]  # [N, K / G]
    levels = torch.empty(n, k, dtype=torch.int32, device=weight.device)

    def round_column(values: torch.Tensor, column: int) -> torch.Tensor:
        scale, zero = scales[:, column // group_size], zeros[:, column // group_size]
        levels[:, column] = q = round_to_grid(values, scale, zero)
        return (q - zero) * scale

    gptq(weight, hessian, round_column)
    return levels.T.contiguous(), affine_int4(levels, scales, zeros)


def gptq_fp8(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scales [N]) of weight [N, K] quantized by GPTQ onto e4m3 with one scale
    per output channel (each row's absolute maximum over 448, as quantize_weight sets it), against
    the calibration inputs' `hessian` [K, K]. Runs on the weight's device."""
    scales = rowwise_scales(weight)  # [N, 1]
    codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)

    def round_column(values: torch.Tensor, column: int) -> torch.Tensor:
        codes[:, column] = code = quantize_rows(values[:, None], scales)[:, 0]
        return code.float() * scales[:, 0]

    gptq(weight, hessian, round_column)
    return codes, scales[:, 0]


def gptq(weight: torch.Tensor, hessian: torch.Tensor, round_column: ColumnRounding) -> None:
    """Round every column of weight [N, K] by `round_column(values, k)` (the column's values float32
    [N] as earlier columns' errors left them, and its index k; returns them rounded, float32 [N]) in
    act order, moving each column's rounding error onto the columns not yet rounded. Inputs the
    calibration never set (diag(H) 0) cannot matter to it: their weights are rounded as 0."""
    n, k = weight.shape
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(h.diagonal(), descending=True)
    w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(DAMP * h.diagonal().mean())
    # the upper Cholesky factor of H⁻¹: row i holds how column i's error spreads over the columns after it
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    sources = order.tolist()  # column i of w is the weight's column sources[i]
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block = w[:, start:end]  # a view: the updates below land in w
        errors = torch.empty(n, end - start, device=w.device)
        for i in range(end - start):
            column = start + i
            rounded = round_column(block[:, i], sources[column])
            errors[:, i] = (block[:, i] - rounded) / inverse[column, column]
            block[:, i:] -= errors[:, i : i + 1] * inverse[column, column:end]
        w[:, end:] -= errors @ inverse[start:end, end:]
