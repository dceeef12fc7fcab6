"""The MoE Triton kernels on a CUDA GPU: bf16 (which the CPU interpreter computes wrongly), Qwen3-30B-A3B
layer shapes, CUDA-graph capture (no host sync) and no recompilation per token count."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import route
from kernels.moe.align_small import _align_small_kernel
from kernels.moe.fused import moe_triton
from kernels.moe.gemm import _moe_gemm_kernel
from kernels.moe.lora_expand import _moe_expand_kernel
from kernels.moe.lora_shrink import _moe_shrink_kernel
from kernels.moe.reference import moe_reference, quantize_experts, route_reference
from kernels.moe.topk_sum import _topk_sum_kernel
from tests.kernels.moe_cases import make_moe_case, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BF16_TOL = 2e-2
A3B = {"hidden": 2048, "width": 768, "num_experts": 128}
SLOT_RANKS = [32, 16, 0, 32, 8, 32, 32, 16]


@pytest.mark.parametrize("num_tokens", [1, 8, 61, 700, 4200])  # 4,200: past the one-launch alignment
def test_moe_lora_matches_reference_in_bf16(num_tokens: int) -> None:
    case = make_moe_case(num_tokens, **A3B, slot_ranks=SLOT_RANKS, dtype=torch.bfloat16, device="cuda", seed=1)
    weights, ids = route(case.x @ case.router.T, 8, True)
    args = (case.x, weights, ids, case.w13, case.w2, case.lora, case.token_slots, case.slot_scales)
    expected = moe_reference(*args)
    assert rel_err(moe_triton(*args), expected) < BF16_TOL
    assert rel_err(moe_reference(*args[:5]), expected) > 5 * BF16_TOL  # adapters matter


def test_routing_on_gpu_matches_reference() -> None:
    logits = torch.randn(300, 128, device="cuda")
    weights, ids = route(logits, 8, True)
    ref_weights, ref_ids = route_reference(logits, 8, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


def test_captured_graph_replays_new_routing_without_recompiling() -> None:
    case = make_moe_case(16, **A3B, slot_ranks=SLOT_RANKS, dtype=torch.bfloat16, device="cuda", seed=2)

    def forward() -> torch.Tensor:
        weights, ids = route(case.x @ case.router.T, 8, True)
        return moe_triton(case.x, weights, ids, case.w13, case.w2, case.lora, case.token_slots, case.slot_scales)

    forward()  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
    for seed in range(3):  # new inputs and adapters in the same buffers: routing changes, graph replays
        fresh = make_moe_case(16, **A3B, slot_ranks=SLOT_RANKS, dtype=torch.bfloat16, device="cuda", seed=10 + seed)
        case.x.copy_(fresh.x)
        case.token_slots.copy_(fresh.token_slots)
        graph.replay()
        weights, ids = route(case.x @ case.router.T, 8, True)
        expected = moe_reference(case.x, weights, ids, case.w13, case.w2, case.lora, case.token_slots, case.slot_scales)
        assert rel_err(out, expected) < BF16_TOL
    device = torch.cuda.current_device()
    kernels = (_moe_gemm_kernel, _moe_shrink_kernel, _moe_expand_kernel, _align_small_kernel, _topk_sum_kernel)
    compiled = {kernel: len(kernel.device_caches[device][0]) for kernel in kernels}
    for num_tokens in (3, 5, 9, 13):  # same bucket of launch configurations, other token counts
        other = make_moe_case(num_tokens, **A3B, slot_ranks=SLOT_RANKS, dtype=torch.bfloat16, device="cuda", seed=4)
        weights, ids = route(other.x @ other.router.T, 8, True)
        moe_triton(other.x, weights, ids, other.w13, other.w2, other.lora, other.token_slots, other.slot_scales)
    assert {kernel: len(kernel.device_caches[device][0]) for kernel in kernels} == compiled


@pytest.mark.parametrize("num_tokens", [1, 61, 700, 4200])
def test_fp8_experts_with_lora_match_reference_in_bf16(num_tokens: int) -> None:
    """W8A16 experts at Qwen3-30B-A3B shapes: fp8 widened to bf16 in the grouped GEMM's registers."""
    case = make_moe_case(num_tokens, **A3B, slot_ranks=SLOT_RANKS, dtype=torch.bfloat16, device="cuda", seed=5)
    weights, ids = route(case.x @ case.router.T, 8, True)
    (w13, s13), (w2, s2) = quantize_experts(case.w13), quantize_experts(case.w2)
    args = (case.x, weights, ids, w13, w2, case.lora, case.token_slots, case.slot_scales)
    expected = moe_reference(*args, w13_scale=s13, w2_scale=s2)
    assert rel_err(moe_triton(*args, w13_scale=s13, w2_scale=s2), expected) < BF16_TOL
    assert rel_err(moe_reference(*args[:3], case.w13, case.w2, *args[5:]), expected) > BF16_TOL  # fp8 mattered
