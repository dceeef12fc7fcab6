"""The MoE Triton kernels against the torch reference on random inputs (CPU: through the
interpreter, fp32/fp16; bf16 runs in test_moe_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import fused
from kernels.moe.align import adapter_expert_blocks, align_pairs, expert_blocks
from kernels.moe.align_large import align_pairs_large
from kernels.moe.align_small import align_pairs_small
from kernels.moe.configs import GemmConfig, MoEPlan, ShrinkConfig
from kernels.moe.fused import moe_triton
from kernels.moe.gemm import moe_gemm
from kernels.moe.reference import moe_reference, quantize_experts, route_reference
from kernels.moe.routing import topk_softmax
from kernels.moe.topk_sum import topk_sum
from tests.kernels.moe_cases import make_moe_case, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 tl.dot is tf32 on a GPU (3.5e-3 relative measured on the H200 through both GEMMs and the
# LoRA), exact in the interpreter
FP32_TOL = 1e-2 if DEVICE == "cuda" else 1e-5
SHAPE = {"hidden": 64, "width": 48, "num_experts": 8}


def test_align_groups_pairs_into_padded_blocks_of_one_group() -> None:
    groups = torch.tensor([1, 0, 1, 1, 2, 1, 3])  # group 3 == num_groups: left out
    blocks = align_pairs(groups, num_groups=3, block_m=2)
    rows = blocks.sorted_pairs.view(-1, 2)
    seen = []
    for block, group in enumerate(blocks.block_groups.tolist()):
        pairs = [p for p in rows[block].tolist() if p < 7]
        if group < 0:
            assert pairs == []
            continue
        assert pairs and all(groups[p] == group for p in pairs)
        seen += pairs
    assert sorted(seen) == [0, 1, 2, 3, 4, 5]


def test_adapter_expert_blocks_leave_out_tokens_without_adapter() -> None:
    ids = torch.tensor([[0, 2], [1, 2], [2, 0]])
    blocks = adapter_expert_blocks(ids, torch.tensor([1, -1, 0]), num_slots=2, num_experts=3, block_m=4)
    used = blocks.block_groups[blocks.block_groups >= 0].tolist()
    assert used == [0 * 3 + 0, 0 * 3 + 2, 1 * 3 + 0, 1 * 3 + 2]  # (slot, expert) groups, ascending
    assert sorted(p for p in blocks.sorted_pairs.tolist() if p < 6) == [0, 1, 4, 5]


@pytest.mark.parametrize("align", [align_pairs_small, align_pairs_large])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "num_slots", "block_m"),
    [(5, 1, 3, 0, 2), (8, 8, 128, 8, 16), (300, 1, 128, 0, 16), (680, 3, 3, 3, 64), (250, 8, 16, 0, 16)],
)
def test_triton_alignment_matches_the_torch_one(
    align, num_tokens: int, top_k: int, num_experts: int, num_slots: int, block_m: int
) -> None:
    """num_slots 0: by expert; else by (slot, expert), tokens of slot -1 left out. 680 x 3 and
    250 x 8 pairs span several programs of align_large.py's count and place launches."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32) if num_slots else None
    if slots is None:
        num_groups, groups = num_experts, ids.reshape(-1)
    else:
        num_groups = num_slots * num_experts
        pair_slots = slots.repeat_interleave(top_k)
        groups = torch.where(pair_slots >= 0, pair_slots * num_experts + ids.reshape(-1), num_groups)
    expected = align_pairs(groups, num_groups, block_m)  # CPU tensors: the torch version
    got = align(ids.to(DEVICE), num_experts, num_groups, block_m, None if slots is None else slots.to(DEVICE))
    assert torch.equal(got.block_groups.cpu(), expected.block_groups)
    # each group's blocks hold the same pairs (their order inside a group is the atomics' order),
    # padding included, and the rows past the last block are padding alone
    rows_group = expected.block_groups.repeat_interleave(block_m)
    for group in range(-1, num_groups):
        got_pairs = got.sorted_pairs.cpu()[rows_group == group].sort().values
        assert torch.equal(got_pairs, expected.sorted_pairs[rows_group == group].sort().values), group


def test_topk_sum_adds_the_delta_to_each_tokens_pairs() -> None:
    gen = torch.Generator().manual_seed(0)
    y, delta = (torch.randn(7 * 3, 40, generator=gen).to(DEVICE) for _ in range(2))
    expected = (y + delta).view(7, 3, 40).sum(dim=1)
    torch.testing.assert_close(topk_sum(y, delta, 3), expected)


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_reference(renormalize: bool) -> None:
    logits = torch.randn(37, 12, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    weights, ids = topk_softmax(logits, 3, renormalize)
    ref_weights, ref_ids = route_reference(logits, 3, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_gemm_applies_each_pairs_expert_and_weight(dtype: torch.dtype, num_tokens: int) -> None:
    case = make_moe_case(num_tokens, **SHAPE, slot_ranks=[4], dtype=dtype, device=DEVICE, seed=num_tokens)
    weights, ids = route_reference(case.x.float() @ case.router.float().T, 2, True)
    config = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2)
    blocks = expert_blocks(ids, SHAPE["num_experts"], config.block_m)
    out = moe_gemm(case.x, case.w13, blocks, 2, config, weights=weights.reshape(-1))
    pair_tokens = torch.arange(num_tokens, device=DEVICE).repeat_interleave(2)
    expected = torch.einsum("ph,pnh->pn", case.x[pair_tokens].float(), case.w13[ids.reshape(-1).long()].float())
    assert rel_err(out, expected * weights.reshape(-1, 1)) < (FP32_TOL if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("beside_pairs", [fused.BESIDE_PAIRS, 0], ids=["beside", "inline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "split_k", "n_tiles"), [(1, 1, 3), (9, 2, 1), (50, 4, 3)])
def test_moe_with_lora_matches_reference(
    dtype: torch.dtype, num_tokens: int, split_k: int, n_tiles: int, beside_pairs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both LoRA paths of fused.py: deltas beside the GEMMs, and expands in place after them; expand
    programs of one column tile, or of three (a whole gate or up half; down's 64 columns in 48 + 16)."""
    monkeypatch.setattr(fused, "BESIDE_PAIRS", beside_pairs)
    case = make_moe_case(num_tokens, **SHAPE, slot_ranks=[8, 0, 4, 16], dtype=dtype, device=DEVICE, seed=7)
    weights, ids = route_reference(case.x.float() @ case.router.float().T, 3, False)
    args = (case.x, weights, ids, case.w13, case.w2, case.lora, case.token_slots, case.slot_scales)
    # expand tiles of 16 columns split gate | up (width 48): the block-diagonal expand runs
    gemm, expand = GemmConfig(block_m=16, block_n=32, block_k=32), GemmConfig(block_m=16, block_n=16, n_tiles=n_tiles)
    shrink = ShrinkConfig(block_m=16, block_k=16, split_k=split_k)
    out = moe_triton(*args, plan=MoEPlan(gemm, gemm, shrink, expand, shrink, expand))
    expected = moe_reference(*args)
    base = moe_reference(*args[:5])
    assert rel_err(out, expected) < (FP32_TOL if dtype == torch.float32 else 3e-3)
    assert rel_err(expected, base) > 0.05  # the adapters change the output: the test can fail


def test_moe_without_adapters_matches_reference() -> None:
    case = make_moe_case(23, **SHAPE, slot_ranks=[4], dtype=torch.float32, device=DEVICE, seed=3)
    weights, ids = route_reference(case.x @ case.router.T, 2, True)
    out = moe_triton(case.x, weights, ids, case.w13, case.w2)
    assert rel_err(out, moe_reference(case.x, weights, ids, case.w13, case.w2)) < FP32_TOL


# hidden 72 and width 40: K tiles of 32 leave a remainder in both GEMMs (the masked K loop), and
# 2I = 80 columns leave a partial N tile
ODD_SHAPE = {"hidden": 72, "width": 40, "num_experts": 5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (7, 3), (40, 2)])
def test_fp8_grouped_gemm_dequantizes_each_experts_rows_in_registers(
    dtype: torch.dtype, num_tokens: int, top_k: int
) -> None:
    case = make_moe_case(num_tokens, **ODD_SHAPE, slot_ranks=[4], dtype=dtype, device=DEVICE, seed=num_tokens)
    weights, ids = route_reference(case.x.float() @ case.router.float().T, top_k, True)
    w13, scale = quantize_experts(case.w13)
    config = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2)
    blocks = expert_blocks(ids, ODD_SHAPE["num_experts"], config.block_m)
    out = moe_gemm(case.x, w13, blocks, top_k, config, weights=weights.reshape(-1), scale=scale)
    pair_tokens = torch.arange(num_tokens, device=DEVICE).repeat_interleave(top_k)
    dequantized = w13.float() * scale[:, :, None]
    expected = torch.einsum("ph,pnh->pn", case.x[pair_tokens].float(), dequantized[ids.reshape(-1).long()])
    assert rel_err(out, expected * weights.reshape(-1, 1)) < (FP32_TOL if dtype == torch.float32 else 2e-3)


def test_fp8_grouped_gemm_refuses_fp8_weights_without_scales() -> None:
    case = make_moe_case(3, **SHAPE, slot_ranks=[4], dtype=torch.float32, device=DEVICE, seed=0)
    _, ids = route_reference(case.x @ case.router.T, 2, True)
    w13, _ = quantize_experts(case.w13)
    blocks = expert_blocks(ids, SHAPE["num_experts"], 16)
    with pytest.raises(ValueError, match="an fp8 w needs its scales"):
        moe_gemm(case.x, w13, blocks, 2, GemmConfig(block_m=16), scale=None)


@pytest.mark.parametrize("beside_pairs", [fused.BESIDE_PAIRS, 0], ids=["beside", "inline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (9, 3), (33, 2)])
def test_fp8_experts_with_lora_match_the_dequantized_reference(
    dtype: torch.dtype, num_tokens: int, top_k: int, beside_pairs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W8A16 experts: the fused path against the reference on the same fp8 weights, which is the
    unquantized reference run on the dequantized weights; the expert LoRA adds on top as before."""
    monkeypatch.setattr(fused, "BESIDE_PAIRS", beside_pairs)
    case = make_moe_case(num_tokens, **ODD_SHAPE, slot_ranks=[8, 0, 4], dtype=dtype, device=DEVICE, seed=11)
    weights, ids = route_reference(case.x.float() @ case.router.float().T, top_k, False)
    (w13, s13), (w2, s2) = quantize_experts(case.w13), quantize_experts(case.w2)
    lora = (case.lora, case.token_slots, case.slot_scales)
    gemm, expand = GemmConfig(block_m=16, block_n=32, block_k=32), GemmConfig(block_m=16, block_n=16, n_tiles=2)
    shrink = ShrinkConfig(block_m=16, block_k=16, split_k=2)
    plan = MoEPlan(gemm, gemm, shrink, expand, shrink, expand)
    out = moe_triton(case.x, weights, ids, w13, w2, *lora, plan, w13_scale=s13, w2_scale=s2)
    expected = moe_reference(case.x, weights, ids, w13, w2, *lora, w13_scale=s13, w2_scale=s2)
    dequantized = (w13.float() * s13[..., None]).to(dtype), (w2.float() * s2[..., None]).to(dtype)
    if dtype == torch.float32:  # in float32 the dequantized weights are exact: the same sums
        torch.testing.assert_close(expected, moe_reference(case.x, weights, ids, *dequantized, *lora))
    assert rel_err(out, expected) < (FP32_TOL if dtype == torch.float32 else 3e-3)
    unquantized = moe_reference(case.x, weights, ids, case.w13, case.w2, *lora)
    # the experts really ran in fp8 (e4m3's 3 mantissa bits: measured 3.7-4.6% from the unquantized
    # layer), well past every tolerance above: the test can fail
    assert rel_err(expected, unquantized) > 2e-2
