"""The Triton LoRA paths on a CUDA GPU: bf16 (which the CPU interpreter computes wrongly), the
dispatcher, paged weights (16-rank pages, scrambled page tables), CUDA-graph capture and the
absence of host syncs and per-batch recompilation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernels.lora import LoRABatch, add_lora, linear_deferred_with_plan, linear_with_plan, lora_linear
from kernels.lora.configs import GatherConfig, default_plan
from kernels.lora.fused import _fused_kernel
from kernels.lora.shrink import _shrink_kernel
from tests.kernels.lora_cases import make_case, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BF16_TOL = 1e-2
RANKS = [16, 8, 64, 0, 32, 16, 128, 16, 8, 16, 64, 16, 16, 32, 8, 16]
PAGE_RANK = 16  # production pages: RANKS take 1 to 8 pages, 8 per slot at max rank 128
PATHS = [("fused", None), ("split", None), ("split", GatherConfig()), ("overlap", None), ("overlap", GatherConfig())]


@pytest.mark.parametrize("page_rank", [None, PAGE_RANK], ids=["unpaged", "paged"])
@pytest.mark.parametrize("num_tokens", [1, 33, 300, 1500])
@pytest.mark.parametrize(("path", "expand"), PATHS)
def test_every_path_matches_the_reference_in_bf16(
    path: str, expand: GatherConfig | None, num_tokens: int, page_rank: int | None
) -> None:
    case = make_case(num_tokens, 1024, [1024, 256, 256], RANKS, dtype=torch.bfloat16, device="cuda",
                     page_rank=page_rank, seed=num_tokens)  # fmt: skip
    plan = dataclasses.replace(default_plan(num_tokens, 128), path=path, gather=expand)
    y = linear_with_plan(plan, case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.linear()) < BF16_TOL


@pytest.mark.parametrize("num_tokens", [7, 900])
def test_add_lora_accumulates_in_place(num_tokens: int) -> None:
    case = make_case(num_tokens, 2048, [1536, 1536], RANKS, dtype=torch.float16, device="cuda", seed=3)
    y = torch.randn(num_tokens, case.width, device="cuda", dtype=torch.float16)
    expected = case.delta(y)
    add_lora(y, case.x, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, expected) < 2e-3


def test_building_metadata_and_running_the_kernels_never_syncs_with_the_host() -> None:
    case = make_case(64, 512, [512], RANKS, dtype=torch.bfloat16, device="cuda", page_rank=PAGE_RANK)
    lora_linear(case.x, case.weight, None, case.lora_a, case.lora_b, case.batch)  # compile first
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = LoRABatch.build(
            case.batch.token_slots, case.batch.slot_ranks, case.batch.slot_scales, case.batch.slot_pages
        )
        lora_linear(case.x, case.weight, None, case.lora_a, case.lora_b, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_token_counts_share_one_compiled_kernel() -> None:
    case = make_case(40, 512, [256, 128], RANKS, dtype=torch.bfloat16, device="cuda")
    caches = {
        kernel: kernel.device_caches[torch.cuda.current_device()][0] for kernel in (_fused_kernel, _shrink_kernel)
    }
    before = {kernel: len(cache) for kernel, cache in caches.items()}
    fused = dataclasses.replace(default_plan(16, 128), path="fused")
    split = dataclasses.replace(default_plan(1024, 128), path="split")
    for plan, token_counts in ((fused, (1, 2, 5, 16, 17, 32, 40)), (split, (100, 333, 1024))):
        for num_tokens in token_counts:
            sub = make_case(num_tokens, 512, [256, 128], RANKS, dtype=torch.bfloat16, device="cuda", seed=num_tokens)
            linear_with_plan(plan, sub.x, case.weight, None, case.lora_a, case.lora_b, sub.batch)
    assert all(len(cache) - before[kernel] <= 1 for kernel, cache in caches.items())


def test_a_captured_step_replays_with_new_slot_assignments_and_moved_pages() -> None:
    case = make_case(32, 1024, [1024, 256, 256], RANKS, dtype=torch.bfloat16, device="cuda", page_rank=PAGE_RANK,
                     spare_pages=8, seed=5)  # fmt: skip
    token_slots = case.batch.token_slots.clone()
    slot_pages = case.batch.slot_pages  # the persistent table the graph reads

    def step() -> torch.Tensor:
        batch = LoRABatch.build(token_slots, case.batch.slot_ranks, case.batch.slot_scales, slot_pages)
        return lora_linear(case.x, case.weight, case.bias, case.lora_a, case.lora_b, batch)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    token_slots.copy_(torch.randint(-1, len(RANKS), (32,), device="cuda"))
    # the rank-128 adapter moves to the pool's 8 spare pages (in decreasing order), and its old
    # pages are overwritten: the replay must read the page table as it is now
    slot = RANKS.index(128)
    old = slot_pages[slot].tolist()
    owned = {p for s, rank in enumerate(RANKS) for p in slot_pages[s, : -(-rank // PAGE_RANK)].tolist()}
    new = sorted(set(range(case.lora_a[0].shape[0])) - owned, reverse=True)
    assert len(new) == 8
    for a, b in zip(case.lora_a, case.lora_b, strict=True):
        a[new], b[new] = a[old], b[old]
        a[old], b[old] = float("nan"), float("nan")
    slot_pages[slot] = torch.tensor(new, dtype=torch.int32, device="cuda")
    case.batch = LoRABatch.build(token_slots, case.batch.slot_ranks, case.batch.slot_scales, slot_pages)
    graph.replay()
    assert rel_err(y, case.linear()) < BF16_TOL


@pytest.mark.parametrize("num_tokens", [1, 33, 1500])
@pytest.mark.parametrize(("path", "expand"), PATHS)
def test_a_deferred_delta_or_one_into_the_residual_sums_to_the_projection(
    path: str, expand: GatherConfig | None, num_tokens: int
) -> None:
    """The overlap path leaves the delta to the caller (beside the GEMM); every other path puts it in
    y. Either way y + delta, and y + the residual's increase, are the projection."""
    case = make_case(num_tokens, 1024, [1024, 256, 256], RANKS, dtype=torch.bfloat16, device="cuda",
                     page_rank=PAGE_RANK, seed=num_tokens + 1)  # fmt: skip
    plan = dataclasses.replace(default_plan(num_tokens, 128), path=path, gather=expand)
    args = (case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
    expected = case.linear()

    y, delta = linear_deferred_with_plan(plan, *args)
    assert (delta is not None) == (path == "overlap")
    if delta is not None:
        assert rel_err(y, F.linear(case.x, case.weight, case.bias)) < BF16_TOL  # the base projection alone
        y = y + delta
    assert rel_err(y, expected) < BF16_TOL

    before = torch.randn(num_tokens, case.width, device="cuda", dtype=torch.bfloat16)
    residual = before.clone()
    y = linear_with_plan(plan, *args, residual=residual)
    assert torch.equal(residual, before) == (path != "overlap")
    assert rel_err(y.float() + residual.float() - before.float(), expected) < BF16_TOL


def test_a_captured_layer_replays_its_deferred_deltas() -> None:
    """The side stream's shrink and expand join the capture: replayed with new inputs and slots, the
    deferred delta and the residual's are those of the new batch."""
    case = make_case(32, 1024, [1024, 256, 256], RANKS, dtype=torch.bfloat16, device="cuda", page_rank=PAGE_RANK,
                     seed=9)  # fmt: skip
    plan = dataclasses.replace(default_plan(32, 128), path="overlap")
    token_slots = case.batch.token_slots.clone()
    residual = torch.zeros(32, case.width, device="cuda", dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        residual.zero_()
        batch = LoRABatch.build(token_slots, case.batch.slot_ranks, case.batch.slot_scales, case.batch.slot_pages)
        args = (case.x, case.weight, case.bias, case.lora_a, case.lora_b, batch)
        y, delta = linear_deferred_with_plan(plan, *args)
        return y, delta, linear_with_plan(plan, *args, residual=residual)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, delta, y_again = step()
    assert delta is not None
    token_slots.copy_(torch.randint(-1, len(RANKS), (32,), device="cuda"))
    case.x.copy_(torch.randn_like(case.x))
    case.batch = LoRABatch.build(token_slots, case.batch.slot_ranks, case.batch.slot_scales, case.batch.slot_pages)
    graph.replay()
    expected = case.linear()
    assert rel_err(y + delta, expected) < BF16_TOL
    assert rel_err(y_again + residual, expected) < BF16_TOL
