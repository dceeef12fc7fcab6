"""Paged LoRA weights (S-LoRA's unified paging): pages of 16 rank rows, adapters of mixed ranks
scattered over the pool through a scrambled page table, every kernel path against the reference,
and the reference against a per-token walk of the page table (CPU: through the Triton interpreter,
fp16 and fp32 only, see test_lora_kernels.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kernels.lora import LoRABatch, add_lora, linear_with_plan, lora_linear
from kernels.lora.configs import Plan
from kernels.lora.expand import lora_expand
from kernels.lora.expand_gather import lora_expand_gather
from kernels.lora.fused import lora_fused
from kernels.lora.reference import add_lora_reference
from kernels.lora.shrink import lora_shrink
from kernels.lora.tiles import check_slices, slice_groups
from tests.kernels.lora_cases import LoRACase, make_case, rel_err
from tests.kernels.test_lora_kernels import DEVICE, EXPAND, FUSED, GATHER, SHRINK, TOL, poisoned

PAGE_RANK = 16
# 10 slots of up to 4 pages in a pool of 19 + 2 pages (room for 5 slots at max rank); a rank-0
# slot; ranks within a page (8), on page boundaries (16, 32, 64) and across them (48)
PAGED = {
    "num_tokens": 45,
    "k": 72,
    "widths": [40, 24, 17],
    "ranks": [8, 16, 32, 48, 64, 0, 16, 8, 32, 64],
    "max_rank": 64,
    "page_rank": PAGE_RANK,
}
KERNELS = ["grouped", "gather", "fused"]


def run_kernel(kernel: str, case: LoRACase, y: torch.Tensor | None) -> torch.Tensor:
    """y += the LoRA delta, by one kernel path."""
    group = slice_groups(case.lora_a, case.lora_b)[0]
    if kernel == "fused":
        lora_fused(y, case.x, group, case.batch, FUSED)
        return y
    z = lora_shrink(case.x, group, case.batch, SHRINK)
    if kernel == "grouped":
        lora_expand(y, z, group, case.batch, EXPAND)
    else:
        lora_expand_gather(y, z, group, case.batch, GATHER)
    return y


def test_the_case_scatters_pages_and_overcommits_the_pool() -> None:
    case = make_case(**PAGED)
    pages, ranks = case.batch.slot_pages, case.batch.slot_ranks.tolist()
    assert pages.shape == (10, 4) and case.lora_a[0].shape == (21, PAGE_RANK, 72)
    assert case.batch.num_slots > case.lora_a[0].shape[0] // case.batch.pages_per_slot
    used = [pages[s, : -(-ranks[s] // PAGE_RANK)].tolist() for s in range(10)]
    assert len({p for row in used for p in row}) == sum(map(len, used))  # no page serves two slots
    for row in used:
        assert all(a > b + 1 for a, b in itertools.pairwise(row))  # decreasing, never adjacent


def test_reference_walks_the_page_table_per_token() -> None:
    case = make_case(**PAGED, dtype=torch.float32, seed=1)
    batch = case.batch
    y = torch.zeros(case.x.shape[0], case.width)
    add_lora_reference(y, case.x, case.lora_a, case.lora_b, batch)

    naive = torch.zeros_like(y)
    for t, slot in enumerate(batch.token_slots.tolist()):
        if slot < 0:
            continue
        rank, scale = int(batch.slot_ranks[slot]), float(batch.slot_scales[slot])
        offset = 0
        for a, b in zip(case.lora_a, case.lora_b, strict=True):
            for r in range(rank):
                page = int(batch.slot_pages[slot, r // PAGE_RANK])
                z = torch.dot(case.x[t].double(), a[page, r % PAGE_RANK].double())
                naive[t, offset : offset + b.shape[1]] += (scale * z * b[page, :, r % PAGE_RANK].double()).float()
            offset += b.shape[1]
    assert rel_err(y, naive) < 1e-6
    assert y[batch.token_slots < 0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_reads_scattered_pages_of_mixed_ranks(dtype: torch.dtype, kernel: str) -> None:
    case = make_case(**PAGED, dtype=dtype, device=DEVICE, seed=2)
    y = torch.randn(case.x.shape[0], case.width, device=DEVICE).to(dtype)
    reference = case.delta(y)
    assert rel_err(run_kernel(kernel, case, y), reference) < TOL[dtype]


@pytest.mark.parametrize("kernel", ["fused", "grouped", "gather"])
def test_write_mode_over_pages_sets_every_row_to_bias_plus_delta(kernel: str) -> None:
    case = make_case(**PAGED, device=DEVICE, seed=3)
    group = slice_groups(case.lora_a, case.lora_b)[0]
    y = poisoned(case.x.shape[0], case.width, torch.float16)
    if kernel == "fused":
        lora_fused(y, case.x, group, case.batch, FUSED, bias=case.bias, accumulate=False)
    else:
        z = lora_shrink(case.x, group, case.batch, SHRINK)
        expand = lora_expand if kernel == "grouped" else lora_expand_gather
        expand(y, z, group, case.batch, EXPAND if kernel == "grouped" else GATHER, bias=case.bias, accumulate=False)
    assert rel_err(y, case.delta(case.bias.expand(case.x.shape[0], -1))) < TOL[torch.float16]


def test_shrink_of_a_paged_slot_is_x_times_its_gathered_rank_rows() -> None:
    case = make_case(num_tokens=20, k=64, widths=[16], ranks=[48, 64, 16], base_fraction=0.0, **{
        "max_rank": 64, "page_rank": PAGE_RANK, "device": DEVICE, "seed": 4})  # fmt: skip
    group = slice_groups(case.lora_a, case.lora_b)[0]
    z = lora_shrink(case.x, group, case.batch, SHRINK).sum(0)[0]  # [T, R_PAD]
    pages = case.batch.slot_pages.long()
    for t, slot in enumerate(case.batch.token_slots.tolist()):
        rank = int(case.batch.slot_ranks[slot])
        a = case.lora_a[0][pages[slot]].reshape(-1, 64)[:rank]  # [rank, K] in rank order
        assert rel_err(z[t, :rank], case.x[t].float() @ a.float().T) < 2e-3
        assert torch.all(z[t, rank:] == 0)


@pytest.mark.parametrize(
    "plan",
    [Plan(path="fused"), Plan(path="split"), Plan(path="split", gather=GATHER)],
    ids=["fused", "split", "split-gather"],
)
def test_the_dispatcher_paths_over_pages(plan: Plan) -> None:
    case = make_case(**PAGED | {"widths": [16, 24, 16, 20]}, device=DEVICE, seed=5)  # 4 slices: two launches
    plan = dataclasses.replace(plan, fused=FUSED, shrink=SHRINK, expand=EXPAND)
    y = linear_with_plan(plan, case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.linear()) < TOL[torch.float16]


def test_cpu_dispatch_over_pages_is_the_reference() -> None:
    case = make_case(**PAGED, seed=6)
    y = lora_linear(case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.linear()) < TOL[torch.float16]
    y = torch.zeros(case.x.shape[0], case.width).half()
    add_lora(y, case.x, case.lora_a, case.lora_b, case.batch)
    assert rel_err(y, case.delta(torch.zeros_like(y))) < TOL[torch.float16]


def reuse_pages_of_a_larger_adapter(case: LoRACase, slot: int, rank: int) -> list[tuple[int, int]]:
    """Give `slot` (rank 64, four pages) a rank-`rank` adapter in its first pages, as a pool that
    reuses the pages in place would, leaving the old adapter's rows past `rank` (and its later pages,
    still in the table) behind. Returns the (page, first stale row) of each stale page."""
    case.batch.slot_ranks[slot] = rank
    case.batch = LoRABatch.build(case.batch.token_slots, case.batch.slot_ranks, case.batch.slot_scales,
                                 case.batch.slot_pages)  # fmt: skip
    pages = case.batch.slot_pages[slot].tolist()
    return [(page, max(0, rank - j * PAGE_RANK)) for j, page in enumerate(pages) if rank < (j + 1) * PAGE_RANK]


@pytest.mark.parametrize("kernel", [*KERNELS, "reference"])
def test_a_reused_page_contributes_nothing_past_the_new_rank(kernel: str) -> None:
    case = make_case(**PAGED, device=DEVICE, seed=7)
    slot = case.batch.slot_ranks.tolist().index(64)
    stale = reuse_pages_of_a_larger_adapter(case, slot, rank=24)  # page 0 whole, page 1 rows 8.., pages 2-3
    assert [first for _, first in stale] == [8, 0, 0]
    case.batch.token_slots[: case.x.shape[0] // 2] = slot  # plenty of tokens on the reused slot
    case.batch = LoRABatch.build(case.batch.token_slots, case.batch.slot_ranks, case.batch.slot_scales,
                                 case.batch.slot_pages)  # fmt: skip

    def run(case: LoRACase) -> torch.Tensor:
        y = torch.zeros(case.x.shape[0], case.width, device=DEVICE).half()
        if kernel == "reference":
            add_lora_reference(y, case.x, case.lora_a, case.lora_b, case.batch)
            return y
        return run_kernel(kernel, case, y)

    clean = dataclasses.replace(case, lora_a=[a.clone() for a in case.lora_a], lora_b=[b.clone() for b in case.lora_b])
    for page, first in stale:  # the stale rows: NaN in one copy, zero in the other
        for a, b, a_clean, b_clean in zip(case.lora_a, case.lora_b, clean.lora_a, clean.lora_b, strict=True):
            a[page, first:] = float("nan")
            b[page, :, first:] = float("nan")
            a_clean[page, first:] = 0
            b_clean[page, :, first:] = 0
    assert torch.equal(run(case), run(clean))


def test_paged_weights_are_checked_against_each_other_and_the_page_table() -> None:
    case = make_case(**PAGED, seed=8)
    assert check_slices(case.x, case.lora_a, case.lora_b, case.batch) == (64, 81)
    b_wrong_pr = [b[:, :, :8].contiguous() for b in case.lora_b]
    with pytest.raises(ValueError, match=r"PR=16"):
        check_slices(case.x, case.lora_a, b_wrong_pr, case.batch)
    b_wrong_pages = [b[:-1] for b in case.lora_b]
    with pytest.raises(ValueError, match=r"P=21"):
        check_slices(case.x, case.lora_a, b_wrong_pages, case.batch)
    with pytest.raises(ValueError, match=r"\[P, PR, K=72\]"):
        check_slices(case.x, [case.lora_a[0], case.lora_a[1][:, :8].contiguous(), case.lora_a[2]], case.lora_b,
                     case.batch)  # fmt: skip
