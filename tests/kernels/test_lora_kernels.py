"""The Triton LoRA kernels against the plain-torch reference, launched directly (on CPU through the
Triton interpreter, which computes bf16 dots wrongly: fp16 and fp32 here, bf16 in test_lora_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import add_lora, linear_with_plan, lora_linear
from kernels.lora.configs import ExpandConfig, FusedConfig, GatherConfig, Plan, ShrinkConfig
from kernels.lora.expand import lora_expand
from kernels.lora.expand_gather import lora_expand_gather
from kernels.lora.fused import lora_fused
from kernels.lora.metadata import TILE_HEIGHTS
from kernels.lora.shrink import lora_shrink
from kernels.lora.tiles import slice_groups
from tests.kernels.lora_cases import make_case, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3}
FUSED = FusedConfig(block_m=16, block_n=16, block_k=32, n_chunk=32)
SHRINK = ShrinkConfig(block_m=16, block_k=32, split_k=2)
EXPAND = ExpandConfig(block_m=16, block_n=32)
GATHER = GatherConfig(block_t=16, block_n=16, r_chunk=16, num_warps=4)
# odd sizes everywhere: K not a multiple of BLOCK_K, widths not multiples of BLOCK_N, T of BLOCK_M
QKV = {"num_tokens": 37, "k": 72, "widths": [40, 24, 17], "ranks": [24, 8, 0, 16, 24]}


def poisoned(num_tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_tokens, width), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_adds_each_tokens_adapter_delta(dtype: torch.dtype) -> None:
    case = make_case(**QKV, dtype=dtype, device=DEVICE, seed=1)
    y = torch.randn(case.x.shape[0], case.width, device=DEVICE).to(dtype)
    expected = case.delta(y)
    lora_fused(y, case.x, slice_groups(case.lora_a, case.lora_b)[0], case.batch, FUSED)
    assert rel_err(y, expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("expand", ["grouped", "gather"])
def test_shrink_then_expand_adds_each_tokens_adapter_delta(dtype: torch.dtype, expand: str) -> None:
    case = make_case(**QKV, dtype=dtype, device=DEVICE, seed=2)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    y = torch.randn(case.x.shape[0], case.width, device=DEVICE).to(dtype)
    expected = case.delta(y)
    z = lora_shrink(case.x, group, case.batch, SHRINK)
    if expand == "grouped":
        lora_expand(y, z, group, case.batch, EXPAND)
    else:
        lora_expand_gather(y, z, group, case.batch, GATHER)
    assert rel_err(y, expected) < TOL[dtype]


@pytest.mark.parametrize("split_k", [1, 3])
def test_shrink_partials_sum_to_x_times_a(split_k: int) -> None:
    case = make_case(num_tokens=21, k=96, widths=[16], ranks=[16, 16, 16], base_fraction=0.0, device=DEVICE, seed=3)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    z = lora_shrink(case.x, group, case.batch, ShrinkConfig(block_m=16, block_k=32, split_k=split_k))
    slots = case.batch.token_slots.long()
    expected = torch.einsum("tk,trk->tr", case.x.float(), case.lora_a[0][slots].float())
    assert rel_err(z.sum(0)[0], expected) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kernel", ["fused", "grouped", "gather"])
def test_write_mode_sets_every_row_to_bias_plus_delta(dtype: torch.dtype, kernel: str) -> None:
    case = make_case(**QKV, dtype=dtype, device=DEVICE, seed=4)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    y = poisoned(case.x.shape[0], case.width, dtype)
    if kernel == "fused":
        lora_fused(y, case.x, group, case.batch, FUSED, bias=case.bias, accumulate=False)
    elif kernel == "grouped":
        z = lora_shrink(case.x, group, case.batch, SHRINK)
        lora_expand(y, z, group, case.batch, EXPAND, bias=case.bias, accumulate=False)
    else:
        z = lora_shrink(case.x, group, case.batch, SHRINK)
        lora_expand_gather(y, z, group, case.batch, GATHER, bias=case.bias, accumulate=False)
    expected = case.delta(case.bias.expand(case.x.shape[0], -1))
    assert rel_err(y, expected) < TOL[dtype]


def test_tokens_without_adapter_leave_y_untouched() -> None:
    case = make_case(num_tokens=9, k=32, widths=[32], ranks=[16, 16], base_fraction=1.0, device=DEVICE)
    y = torch.randn(9, 32, device=DEVICE).half()
    before = y.clone()
    lora_fused(y, case.x, slice_groups(case.lora_a, case.lora_b)[0], case.batch, FUSED)
    assert torch.equal(y, before)


def test_one_adapter_over_several_token_tiles() -> None:
    case = make_case(num_tokens=50, k=64, widths=[48], ranks=[32], base_fraction=0.0, device=DEVICE, seed=6)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    y = torch.zeros(50, 48, device=DEVICE).half()
    lora_expand(y, lora_shrink(case.x, group, case.batch, SHRINK), group, case.batch, EXPAND)
    assert rel_err(y, case.delta(torch.zeros(50, 48))) < TOL[torch.float16]


@pytest.mark.parametrize("block_m", TILE_HEIGHTS)
@pytest.mark.parametrize("kernel", ["fused", "grouped"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_grouped_kernels_at_every_tile_height(block_m: int, kernel: str, accumulate: bool) -> None:
    """Groups of one to several tiles at each height, a rank-0 slot and base tokens: accumulating
    launches cover the slot groups (a prefix of the tile map), writing ones the no-LoRA group too."""
    case = make_case(num_tokens=150, k=40, widths=[24, 8], ranks=[16, 0, 8], device=DEVICE, seed=12)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    y = torch.randn(150, case.width, device=DEVICE).half() if accumulate else poisoned(150, case.width, torch.float16)
    expected = case.delta(y if accumulate else case.bias.expand(150, -1))
    bias = None if accumulate else case.bias
    if kernel == "fused":
        config = FusedConfig(block_m=block_m, block_n=16, block_k=32, n_chunk=32)
        lora_fused(y, case.x, group, case.batch, config, bias=bias, accumulate=accumulate)
    else:
        z = lora_shrink(case.x, group, case.batch, ShrinkConfig(block_m=block_m, block_k=32, split_k=2))
        expand = ExpandConfig(block_m=block_m, block_n=16)
        lora_expand(y, z, group, case.batch, expand, bias=bias, accumulate=accumulate)
    assert rel_err(y, expected) < TOL[torch.float16]


def test_many_adapters_with_mixed_ranks_and_a_single_token() -> None:
    ranks = [8, 16, 32, 64, 8, 16, 32, 64, 0, 8, 16, 24]
    for num_tokens, seed in ((40, 7), (1, 8)):
        case = make_case(num_tokens, 48, [32, 16], ranks, device=DEVICE, base_fraction=0.1, seed=seed)
        plan = Plan(path="fused", fused=FUSED)
        y = linear_with_plan(plan, case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
        assert rel_err(y, case.linear()) < TOL[torch.float16]


@pytest.mark.parametrize("path", ["fused", "split"])
def test_more_slices_than_one_launch_holds(path: str) -> None:
    case = make_case(num_tokens=19, k=32, widths=[16, 24, 16, 20], ranks=[16, 8, 16], device=DEVICE, seed=9)
    plan = Plan(path=path, fused=FUSED, shrink=SHRINK, expand=EXPAND, gather=GATHER)
    y = linear_with_plan(plan, case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.linear()) < TOL[torch.float16]


def test_dispatch_on_cpu_tensors_is_the_reference() -> None:
    case = make_case(**QKV, seed=10)
    y = lora_linear(case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.linear()) < TOL[torch.float16]
    y = torch.zeros(case.x.shape[0], case.width).half()
    add_lora(y, case.x, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.delta(torch.zeros_like(y))) < TOL[torch.float16]


def test_launchers_reject_mismatched_metadata() -> None:
    case = make_case(**QKV, seed=11)
    other = make_case(num_tokens=5, k=72, widths=[40, 24, 17], ranks=[8, 8, 8, 8, 8])
    group = slice_groups(case.lora_a, case.lora_b)[0]
    with pytest.raises(ValueError, match="T=5"):
        lora_shrink(case.x, group, other.batch, SHRINK)
    with pytest.raises(ValueError, match="lora weights are"):
        linear_with_plan(Plan(path="split"), case.x.float(), case.weight, None, case.lora_a, case.lora_b, case.batch)
