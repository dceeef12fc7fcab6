"""GPTQ (kernels/quant/gptq.py) against round to nearest on the same grid, 4-bit and FP8: equal where the
inputs are uncorrelated (no error to move), clearly better on the layer's output where they are
correlated, and a 4-bit grid always a valid GPTQ checkpoint's (zero points 1..15)."""

from __future__ import annotations

import pytest
import torch

from kernels.quant.gptq import gptq_fp8, gptq_int4
from kernels.quant.int4_reference import GPTQ_ZERO_OFFSET, MAX_LEVEL, affine_grid, dequantize_int4, round_to_grid
from kernels.quant.reference import FP8_DTYPE, dequantize, quantize_weight


def correlated_inputs(tokens: int, k: int, seed: int, draw: int = 0) -> torch.Tensor:
    """X [tokens, K] whose inputs mix a few strong directions (the same for one `seed`), as a layer's
    activations do; `draw` picks the tokens."""
    spectrum = torch.logspace(0, -2, k)  # singular values from 1 down to 0.01
    basis, _ = torch.linalg.qr(torch.randn(k, k, generator=torch.Generator().manual_seed(seed)))
    return torch.randn(tokens, k, generator=torch.Generator().manual_seed(1000 + draw)) @ (basis * spectrum) @ basis.T


def round_to_nearest(weight: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [N, K]: `weight` rounded alone on GPTQ's grid (zero points >= GPTQ_ZERO_OFFSET)."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group, group)
    scales, zeros = affine_grid(groups, min_zero=GPTQ_ZERO_OFFSET)
    return ((round_to_grid(groups, scales, zeros) - zeros) * scales).reshape(n, k)


def output_error(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return float((x @ (weight - quantized).T).norm() / (x @ weight.T).norm())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_uncorrelated_inputs_leave_nothing_to_move_so_gptq_rounds_to_nearest(group: int):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    levels, packed = gptq_int4(weight, torch.eye(256) * 3.0, group)
    assert levels.shape == (256, 48) and packed.group_size == group
    assert torch.equal(dequantize_int4(packed), round_to_nearest(weight, group))


@pytest.mark.parametrize("group", [32, 128])
def test_gptq_cuts_the_output_error_of_correlated_inputs(group: int):
    x = correlated_inputs(1024, 256, seed=1)
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    _, packed = gptq_int4(weight, x.T @ x, group)
    gptq = output_error(x, weight, dequantize_int4(packed))
    nearest = output_error(x, weight, round_to_nearest(weight, group))
    assert gptq < 0.6 * nearest, (gptq, nearest)  # measured: 0.44-0.46
    # on inputs it was not calibrated on, drawn the same way, it keeps the gain (measured: 0.46-0.48)
    held_out = correlated_inputs(1024, 256, seed=1, draw=1)
    assert output_error(held_out, weight, dequantize_int4(packed)) < 0.6 * output_error(
        held_out, weight, round_to_nearest(weight, group)
    )


def test_every_grid_is_a_gptq_checkpoints_and_inputs_never_set_are_harmless():
    x = correlated_inputs(256, 128, seed=3)
    x[:, 5] = 0.0  # an input the calibration never set
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(4)) * 0.02
    weight[0] = weight[0].abs()  # a row with nothing below zero: its grid still has a zero point of 1
    weight[1] = 0.0
    levels, packed = gptq_int4(weight, x.T @ x, 32)
    assert int(levels.min()) >= 0 and int(levels.max()) <= MAX_LEVEL
    assert float(packed.zeros.min()) >= GPTQ_ZERO_OFFSET and float(packed.zeros.max()) <= MAX_LEVEL
    dequantized = dequantize_int4(packed)
    assert torch.isfinite(dequantized).all()
    assert torch.equal(dequantized[1], torch.zeros(128))  # zero weights stay exact
    assert float(dequantized[0].min()) >= -float(packed.scales[:, 0].max())  # at most one step below zero
    assert torch.equal(dequantized[:, 5], torch.zeros(16))  # an unset input's weights are dropped


def test_the_grids_minimum_zero_point_keeps_a_positive_groups_maximum_exact():
    groups = torch.tensor([[[0.0, 0.5, 1.0, 1.5]]])
    scales, zeros = affine_grid(groups, min_zero=1)
    assert float(zeros) == 1.0
    top = (round_to_grid(groups, scales, zeros) - zeros) * scales
    assert float(top.max()) == pytest.approx(1.5, rel=1e-3)  # 14 steps of the float16 scale
    assert affine_grid(groups)[1].item() == 0.0  # without the minimum: the plain grid's zero point of 0


def test_fp8_rounds_to_nearest_on_uncorrelated_inputs_and_cuts_the_error_of_correlated_ones():
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(5)) * 0.02
    codes, scales = gptq_fp8(weight, torch.eye(256))
    nearest_codes, nearest_scales = quantize_weight(weight)
    assert torch.equal(codes.float(), nearest_codes.float()) and torch.equal(scales, nearest_scales)

    x = correlated_inputs(1024, 256, seed=6)
    codes, scales = gptq_fp8(weight, x.T @ x)
    assert codes.dtype == FP8_DTYPE and torch.equal(scales, nearest_scales)  # the grid is round to nearest's
    gptq = output_error(x, weight, dequantize(codes, scales))
    nearest = output_error(x, weight, dequantize(nearest_codes, nearest_scales))
    assert gptq < 0.6 * nearest, (gptq, nearest)  # measured: 0.011 against 0.026
