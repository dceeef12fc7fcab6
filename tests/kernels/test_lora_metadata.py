"""LoRABatch.build: the per-step grouping every kernel reads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.lora import LoRABatch
from kernels.lora.metadata import TILE_HEIGHTS
from tests.kernels.lora_cases import identity_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(slots: list[int], ranks: list[int]) -> LoRABatch:
    return LoRABatch.build(
        torch.tensor(slots), torch.tensor(ranks, dtype=torch.int32), torch.ones(len(ranks)), identity_pages(len(ranks))
    )


def test_tokens_are_grouped_by_slot_in_batch_order_with_base_tokens_last() -> None:
    batch = build([2, -1, 0, 2, 0], ranks=[8, 8, 8])
    assert batch.sorted_tokens.tolist() == [2, 4, 0, 3, 1]
    assert batch.group_counts.tolist() == [2, 0, 2, 1]


def test_tokens_of_rank_zero_slots_join_the_base_group() -> None:
    batch = build([1, 0, 1], ranks=[4, 0])
    assert batch.group_counts.tolist() == [1, 0, 2]
    assert batch.sorted_tokens.tolist() == [1, 0, 2]
    assert batch.active_slots.tolist() == [0, -1]
    assert batch.num_active.tolist() == [1]


def test_active_slots_list_slots_with_tokens_ascending_then_minus_one() -> None:
    batch = build([3, 1, 3, -1], ranks=[8, 8, 8, 8, 8])
    assert batch.active_slots.tolist() == [1, 3, -1, -1, -1]
    assert batch.num_active.tolist() == [2]


def test_sorted_positions_carry_slot_rank_and_scale_and_none_without_lora() -> None:
    batch = LoRABatch.build(
        torch.tensor([1, -1, 0, 2, 2]), torch.tensor([8, 0, 4]), torch.tensor([0.5, 2.0, 3.0]), identity_pages(3)
    )
    assert batch.sorted_tokens.tolist() == [2, 3, 4, 0, 1]
    assert batch.sorted_slots.tolist() == [0, 2, 2, -1, -1]
    assert batch.sorted_ranks.tolist() == [8, 4, 4, 0, 0]
    assert batch.sorted_scales.tolist() == [0.5, 3.0, 3.0, 0.0, 0.0]


def test_a_batch_without_adapter_tokens_has_no_active_slot() -> None:
    batch = build([-1, -1], ranks=[16, 16])
    assert batch.num_active.tolist() == [0]
    assert batch.group_counts.tolist() == [0, 0, 2]


def test_build_normalises_dtypes() -> None:
    scales = torch.tensor([1.0, 2.0], dtype=torch.float64)
    batch = LoRABatch.build(torch.tensor([0, 1]), torch.tensor([4, 4]), scales, torch.tensor([[1], [0]]))
    dtypes = (batch.token_slots.dtype, batch.slot_ranks.dtype, batch.slot_scales.dtype, batch.slot_pages.dtype)
    assert dtypes == (torch.int32, torch.int32, torch.float32, torch.int32)
    assert batch.num_tokens == 2 and batch.num_slots == 2 and batch.pages_per_slot == 1


def test_sorted_positions_carry_their_slots_page_table_row() -> None:
    pages = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 3, 4]], dtype=torch.int32)
    batch = LoRABatch.build(torch.tensor([2, -1, 0, 1]), torch.tensor([40, 16, 48]), torch.ones(3), pages)
    assert batch.sorted_tokens.tolist() == [2, 3, 0, 1]
    assert batch.sorted_pages[:3].tolist() == [[5, 2, 0], [7, 0, 0], [1, 3, 4]]
    assert batch.sorted_pages.shape == (4, 3) and batch.pages_per_slot == 3


def test_build_keeps_a_device_page_table_it_need_not_convert() -> None:
    pages = identity_pages(4)
    batch = LoRABatch.build(torch.tensor([0, 3]), torch.full((4,), 8), torch.ones(4), pages)
    assert batch.slot_pages is pages  # a captured graph reads the caller's persistent table


@pytest.mark.parametrize("pages", [torch.zeros(3, dtype=torch.int32), torch.zeros(2, 1), torch.zeros(3, 0)])
def test_a_page_table_must_be_one_row_of_pages_per_slot(pages: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"slot_pages .* must be|at least one page"):
        LoRABatch.build(torch.tensor([0]), torch.full((3,), 8), torch.ones(3), pages)


FIELDS = ("sorted_tokens", "group_counts", "active_slots", "num_active", "sorted_slots", "sorted_ranks",
          "sorted_scales", "sorted_pages", "tile_map")  # fmt: skip


@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "pages_per_slot"),
    [(0, 2, 1), (1, 1, 1), (7, 3, 2), (64, 16, 4), (300, 40, 3), (1024, 5, 8)],
)
def test_the_one_program_build_matches_the_torch_ops(num_tokens: int, num_slots: int, pages_per_slot: int) -> None:
    """The Triton build (on the GPU, or on CPU through the interpreter) against the torch ops on CPU,
    on random batches with base tokens, empty (rank-0) slots and scrambled page tables."""
    gen = torch.Generator().manual_seed(num_tokens + num_slots)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    slot_ranks = torch.randint(0, 3, (num_slots,), generator=gen, dtype=torch.int32) * 8  # a third rank 0
    slot_scales = torch.rand(num_slots, generator=gen) + 0.5
    slot_pages = torch.randint(0, 97, (num_slots, pages_per_slot), generator=gen, dtype=torch.int32)
    reference = LoRABatch.build(token_slots, slot_ranks, slot_scales, slot_pages)  # CPU tensors: torch ops
    built = LoRABatch.build(*(t.to(DEVICE) for t in (token_slots, slot_ranks, slot_scales, slot_pages)))
    for name in FIELDS:  # poisoned: the kernel's outputs may reuse this memory, which must not hold the answer
        setattr(built, name, torch.full_like(getattr(built, name), -7))
    built._build_on_device()
    for name in FIELDS:
        assert torch.equal(getattr(built, name).cpu(), getattr(reference, name)), name


def tile_map_by_hand(token_slots: list[int], ranks: list[int], height: int) -> list[list[int]]:
    """The tile map spelled out: every group's tiles of `height` rows in group order, the no-LoRA
    group (base tokens and rank-0 slots) last, then empty rows up to max_token_tiles(T, S + 1, 16)."""
    num_slots = len(ranks)
    groups = [slot if slot >= 0 and ranks[slot] > 0 else num_slots for slot in token_slots]
    rows, start = [], 0
    for group in range(num_slots + 1):
        count = groups.count(group)
        rows += [[group, row0, count, start] for row0 in range(0, count, height)]
        start += count
    num_rows = -(-len(token_slots) // 16) + min(num_slots + 1, len(token_slots))
    return rows + [[num_slots + 1, 0, 0, 0]] * (num_rows - len(rows))


def test_tile_map_lists_each_groups_tiles_then_the_no_lora_groups_then_empty_rows() -> None:
    batch = build([1] * 40 + [-1, 0, 1], ranks=[8, 8, 8])
    assert batch.token_tiles(16).tolist() == [
        [0, 0, 1, 0],
        [1, 0, 41, 1],
        [1, 16, 41, 1],
        [1, 32, 41, 1],
        [3, 0, 1, 42],
        [4, 0, 0, 0],
        [4, 0, 0, 0],
    ]
    assert batch.token_tiles(32).tolist()[:4] == [[0, 0, 1, 0], [1, 0, 41, 1], [1, 32, 41, 1], [3, 0, 1, 42]]
    assert batch.token_tiles(128).tolist()[3:] == [[4, 0, 0, 0]] * 4


def test_a_tile_height_without_a_map_is_refused() -> None:
    with pytest.raises(ValueError, match="block_m 48 has no tile map"):
        build([0, 1], ranks=[8, 8]).token_tiles(48)


@pytest.mark.parametrize("builder", ["torch", "kernel"])
@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "seed"),
    [(0, 3, 0), (1, 1, 1), (1, 4, 2), (9, 5, 3), (96, 40, 4), (300, 3, 5), (384, 64, 6), (700, 2, 7)],
)
def test_tile_map_matches_one_spelled_out_by_hand(builder: str, num_tokens: int, num_slots: int, seed: int) -> None:
    """Random batches with base tokens, rank-0 and empty slots; few slots give groups of many tiles."""
    gen = torch.Generator().manual_seed(seed)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    slot_ranks = torch.randint(0, 3, (num_slots,), generator=gen, dtype=torch.int32) * 8  # a third rank 0
    args = (token_slots, slot_ranks, torch.ones(num_slots), identity_pages(num_slots))
    batch = LoRABatch.build(*(t.to(DEVICE) for t in args) if builder == "kernel" else args)
    if builder == "kernel":  # the Triton build, on the GPU or through the interpreter, over poison
        batch.tile_map = torch.full_like(batch.tile_map, -7)
        batch._build_on_device()
    for height in TILE_HEIGHTS:
        expected = tile_map_by_hand(token_slots.tolist(), slot_ranks.tolist(), height)
        assert batch.token_tiles(height).tolist() == expected, height


def test_a_programs_tile_read_and_the_build_compile_for_hopper() -> None:
    """Without a GPU, for sm_90: a program reads its tile map row with one 16-byte load and no
    shuffle or barrier (the prefix sum it replaces took four reductions), and the build kernel
    compiles from one token to its largest batch (tests/kernels/lora_tile_compile.py)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.lora_tile_compile"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "tile-read loads=ld.global.v4.b32 shuffles=0 barriers=0",
        "build T=1 S=1",
        "build T=96 S=64",
        "build T=384 S=256",
        "build T=4096 S=256",
    ]
