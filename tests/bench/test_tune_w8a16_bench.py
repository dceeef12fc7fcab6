"""bench.tune_w8a16's shapes and its table row (the tuning itself needs a GPU)."""

from __future__ import annotations

from bench.quant_kernels import SHAPES, roofline_us
from bench.tune_w8a16 import format_row, projections
from kernels.quant.w8a16_plans import W8A16Plan
from kernels.quant.w8a16_tuning import CellResult


def test_the_llama_shapes_tuned_are_the_ones_bench_quant_kernels_times() -> None:
    assert projections("llama-3-8b") == {shape: name for name, shape in SHAPES.items()}


def test_qwen3_30b_a3b_tunes_its_attention_only() -> None:
    assert sorted(projections("qwen3-30b-a3b").values()) == ["o", "qkv"]


def test_a_row_shows_both_plans_their_roofline_fractions_and_the_speed_up() -> None:
    plan = W8A16Plan(16, 32, 256, 2, num_warps=8, num_stages=3, swap=True)
    default = W8A16Plan(16, 64, 128, 4, num_warps=4, num_stages=4)
    bandwidth = 3.0e12
    roof = roofline_us(4096, 4096, 8, 1, bandwidth)
    row = format_row("o", CellResult(4096, 4096, 8, plan, 2 * roof, default, 3 * roof, 30, 1), bandwidth)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells == ["o", "4096", "4096", "8", "m16 n32 k256 split2 w8 s3 swap", f"{2 * roof:.1f}", "0.50",
                     "m16 n64 k128 split4 w4 s4", f"{3 * roof:.1f}", "0.33", "1.50×"]  # fmt: skip
