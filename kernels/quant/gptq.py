"""GPTQ (Frantar et al., 2022): 4-bit weights rounded with second-order error feedback, on the grid
--quantization int4 uses (int4_reference.py: asymmetric, float16 scales, integer zero points).

Round to nearest rounds each weight alone. GPTQ rounds one input column at a time and moves what the
rounding lost onto the columns not yet rounded, weighted by the inverse Hessian of the layer's
squared output error on calibration inputs X [T, K]: H = X.T @ X. The error it minimises is the
layer's output error ||X @ (W - Q).T||², not the weights', so directions the inputs never take
absorb the error of those they do.

- Columns go in "act order": the inputs of largest diag(H) first, while most columns are left to
  absorb their error (on the demo model it halved GPTQ's perplexity cost over columns in order:
  docs/benchmarks.md, "GPTQ").
- With columns out of order a group's columns are rounded at different times, so every group's grid
  is set before any rounding, from the weights as they are ("static groups"). The levels are stored
  in the weight's own column order and each input's group is k // G: the checkpoint is the plain
  (desc_act false) GPTQ format, which every GPTQ reader serves without a permutation.
- Columns are taken in blocks of BLOCK: inside a block each column's error updates the block's
  remaining columns at once; the columns after the block get the block's errors in one GEMM ("lazy
  batch updates"), which keeps the algorithm at GEMM speed on a GPU.
"""

from __future__ import annotations

import torch

from kernels.quant.int4_reference import GPTQ_ZERO_OFFSET, Int4Weight, affine_grid, affine_int4, round_to_grid

# H += DAMP * mean(diag(H)) * I: the GPTQ paper's 1%, keeping the Cholesky factorisation defined
# where calibration inputs are (nearly) collinear
DAMP = 0.01
# columns per lazy-update block
BLOCK = 128


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> tuple[torch.Tensor, Int4Weight]:
    """(4-bit levels int32 [K, N], the packed Int4Weight) of weight [N, K] quantized by GPTQ in groups
    of `group_size` inputs, against the calibration inputs' `hessian` [K, K] (X.T @ X, any positive
    multiple). Every zero point is GPTQ_ZERO_OFFSET or more, so a GPTQ checkpoint can hold the
    weight. Runs in float32 on the weight's device."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of the group size {group_size}")
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # inputs the calibration never set: their weights cannot matter to it
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    grid_scales, grid_zeros = affine_grid(w.reshape(n, k // group_size, group_size), min_zero=GPTQ_ZERO_OFFSET)
    scales, zeros = grid_scales[..., 0], grid_zeros[..., 0]  # [N, K / G]
    order = torch.argsort(h.diagonal(), descending=True)
    w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(DAMP * h.diagonal().mean())
    # the upper Cholesky factor of H⁻¹: row i holds how column i's error spreads over the columns after it
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    sources = order.tolist()  # column i of w is the weight's column sources[i]
    levels = torch.empty(n, k, dtype=torch.int32, device=w.device)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block = w[:, start:end]  # a view: the updates below land in w
        errors = torch.empty_like(block)
        for i in range(end - start):
            column = start + i
            source = sources[column]
            scale, zero = scales[:, source // group_size], zeros[:, source // group_size]
            q = round_to_grid(block[:, i], scale, zero)
            levels[:, source] = q
            errors[:, i] = (block[:, i] - (q - zero) * scale) / inverse[column, column]
            block[:, i:] -= errors[:, i : i + 1] * inverse[column, column:end]
        w[:, end:] -= errors @ inverse[start:end, end:]
    return levels.T.contiguous(), affine_int4(levels, scales, zeros)
