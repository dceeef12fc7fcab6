"""The slot writer's fast path (views built once per page and adapter shape, sources cut by one split)
writes exactly the adapter into its pages, wherever they are in the pool, and zeroes everything else
of those pages, whatever they held before."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.model_info import PROJECTIONS, ModelInfo
from worker.adapter_pool.host_adapter import AdapterPart, BufferLayout, HostAdapter
from worker.adapter_pool.slot_writer import SlotWriter
from worker.model.model import CausalLM

INFO = ModelInfo(
    name="tiny",
    architecture="LlamaForCausalLM",
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    vocab_size=32,
    max_context=64,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    torch_dtype="float32",
)
MAX_RANK = 64
MAX_LORAS = 3  # 12 pages of 16 rank rows
SCRAMBLED = (7, 3, 9, 5)  # where the adapters under test go: pages out of order and apart
NEIGHBOUR = (0,)
UNTOUCHED = (10, 11)


def pages_for(model: CausalLM, rank: int, pages: tuple[int, ...] = SCRAMBLED) -> tuple[int, ...]:
    return pages[: model.pages_for_rank(rank)]


def synthetic_adapter(rank: int, projections: tuple[str, ...], seed: int, *, gap: int = 0) -> HostAdapter:
    """An adapter of random weights on `projections` of every layer, its matrices in a shuffled order
    with `gap` unused elements before each (as a file's data section may order them)."""
    rng = random.Random(seed)
    matrices = []  # (part index, "a" | "b", elements)
    keys = [(layer, projection) for layer in range(INFO.num_layers) for projection in projections]
    for index, (_, projection) in enumerate(keys):
        in_features, out_features = INFO.projection_shape(projection)
        matrices += [(index, "a", rank * in_features), (index, "b", out_features * rank)]
    rng.shuffle(matrices)
    offsets: dict[tuple[int, str], int] = {}
    end = 0
    for index, matrix, size in matrices:
        offsets[(index, matrix)] = end + gap
        end += gap + size
    parts = tuple(
        AdapterPart(layer, projection, offsets[(i, "a")], offsets[(i, "b")], *INFO.projection_shape(projection))
        for i, (layer, projection) in enumerate(keys)
    )
    buffer = torch.randn(end + gap, generator=torch.Generator().manual_seed(seed))
    return HostAdapter(f"adapter-{seed}", rank, 0.5 + seed, buffer, parts)


def page_matrices(model: CausalLM, pages: tuple[int, ...]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) → (A [pages * 16, in], B [out, pages * 16]) of `pages` in rank order, copied."""
    return {
        (index, name): (torch.cat([a[p] for p in pages]), torch.cat([b[p] for p in pages], dim=1))
        for index, layer in enumerate(model.model.layers)
        for linear in layer.lora_linears()
        for name, a, b in zip(linear.projections, linear.lora_a, linear.lora_b, strict=True)
    }


def assert_pages_hold_exactly(model: CausalLM, pages: tuple[int, ...], adapter: HostAdapter) -> None:
    """The adapter's ranks in its projections, zeros everywhere else of its pages, and its slot (the
    first page) pointing at them."""
    parts = {(part.layer, part.projection): part for part in adapter.parts}
    rank = adapter.rank
    for key, (a, b) in page_matrices(model, pages).items():
        part = parts.get(key)
        if part is None:
            assert not a.any() and not b.any(), f"{key} is untargeted but not zero"
            continue
        assert torch.equal(a[:rank], adapter.a(part)), key
        assert torch.equal(b[:, :rank], adapter.b(part)), key
        assert not a[rank:].any() and not b[:, rank:].any(), f"{key} holds entries past rank {rank}"
    slot = pages[0]
    assert model.slot_ranks[slot] == rank
    assert model.slot_scales[slot] == adapter.scaling
    assert model.slot_pages[slot].tolist() == [*pages] + [0] * (model.pages_per_slot - len(pages))


@pytest.fixture
def model() -> CausalLM:
    """Every page filled with nonzero entries, as if written by other means before the writer."""
    model = CausalLM(INFO, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, dtype=torch.float32)
    assert (model.page_rank, model.num_pages) == (16, 12)
    for layer in model.model.layers:
        for linear in layer.lora_linears():
            for pages in (*linear.lora_a, *linear.lora_b):
                pages.fill_(1.0)
    return model


def test_every_write_holds_its_adapter_and_zeros_past_its_rank_and_outside_its_targets(model: CausalLM):
    writer = SlotWriter(model)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    # lower and higher ranks, the same and other targets, in turn into one slot
    sequence = [
        synthetic_adapter(64, PROJECTIONS, seed=1),
        synthetic_adapter(16, PROJECTIONS, seed=2),
        synthetic_adapter(16, PROJECTIONS, seed=3, gap=5),
        synthetic_adapter(8, ("q_proj", "v_proj"), seed=4),
        synthetic_adapter(32, ("q_proj", "v_proj"), seed=5),
        synthetic_adapter(4, attention, seed=6),
        synthetic_adapter(64, ("down_proj",), seed=7),
        synthetic_adapter(16, PROJECTIONS, seed=8),
    ]
    neighbour = synthetic_adapter(8, PROJECTIONS, seed=9)
    writer.write(NEIGHBOUR, neighbour).wait()
    untouched = page_matrices(model, UNTOUCHED)

    for adapter in sequence:
        writer.write(pages_for(model, adapter.rank), adapter).wait()
        assert_pages_hold_exactly(model, pages_for(model, adapter.rank), adapter)
    assert_pages_hold_exactly(model, NEIGHBOUR, neighbour)
    assert all(
        torch.equal(a, a2) and torch.equal(b, b2)
        for (a, b), (a2, b2) in zip(untouched.values(), page_matrices(model, UNTOUCHED).values(), strict=True)
    )


def test_the_pages_of_one_adapter_become_the_first_pages_of_others(model: CausalLM):
    writer = SlotWriter(model)
    writer.write(SCRAMBLED, synthetic_adapter(64, PROJECTIONS, seed=1)).wait()
    # its second and fourth pages, each now a whole lower-rank adapter of other targets
    small = synthetic_adapter(12, ("q_proj", "down_proj"), seed=2)
    wide = synthetic_adapter(20, ("o_proj",), seed=3)
    writer.write((3,), small).wait()
    writer.write((5, 0), wide).wait()

    assert_pages_hold_exactly(model, (3,), small)
    assert_pages_hold_exactly(model, (5, 0), wide)


def test_a_lower_rank_adapter_leaves_zeros_past_its_rank_in_every_projection(model: CausalLM):
    writer = SlotWriter(model)
    writer.write(SCRAMBLED, synthetic_adapter(64, PROJECTIONS, seed=1)).wait()
    lower = synthetic_adapter(9, PROJECTIONS, seed=2)

    writer.write(pages_for(model, 9), lower).wait()

    for key, (a, b) in page_matrices(model, pages_for(model, 9)).items():
        assert not a[9:].any() and not b[:, 9:].any(), key
    assert_pages_hold_exactly(model, pages_for(model, 9), lower)


def test_the_writer_keeps_a_bounded_number_of_page_plans(model: CausalLM):
    writer = SlotWriter(model)
    stretches = [(0, 1, 2, 3), (4, 5, 6, 7), (11, 10, 9, 8)]
    for rank in range(1, MAX_RANK + 1):
        for pages in stretches:
            writer.write(pages_for(model, rank, pages), synthetic_adapter(rank, PROJECTIONS, seed=rank)).wait()
    assert writer.bookkeeping_size() <= 2 * model.num_pages
    assert_pages_hold_exactly(model, stretches[2], synthetic_adapter(MAX_RANK, PROJECTIONS, seed=MAX_RANK))


def test_a_buffer_layout_cuts_every_part_where_its_views_are():
    adapter = synthetic_adapter(4, PROJECTIONS, seed=1, gap=3)
    a_views, b_views = adapter.layout.split(adapter.buffer)

    assert adapter.layout.targets == tuple((part.layer, part.projection) for part in adapter.parts)
    for part, a, b in zip(adapter.parts, a_views, b_views, strict=True):
        assert a.data_ptr() == adapter.a(part).data_ptr() and torch.equal(a, adapter.a(part).flatten())
        assert b.data_ptr() == adapter.b(part).data_ptr() and torch.equal(b, adapter.b(part).flatten())


def test_overlapping_matrices_are_refused():
    adapter = synthetic_adapter(4, ("q_proj",), seed=1)
    first = adapter.parts[0]
    overlapping = dataclasses.replace(adapter.parts[1], a_offset=first.a_offset + 1)
    with pytest.raises(ValueError, match="overlap"):
        BufferLayout.of(4, (first, overlapping), adapter.buffer.numel())


def test_a_write_that_fails_midway_leaves_its_pages_to_be_zeroed_by_the_next(model: CausalLM, monkeypatch):
    writer = SlotWriter(model)
    small = synthetic_adapter(4, ("q_proj",), seed=1)
    writer.write((7,), small).wait()
    copies = []

    def copy_then_fail(destinations, sources):
        if copies:
            raise RuntimeError("device error")
        copies.append(len(destinations))
        for destination, source in zip(destinations, sources, strict=True):
            destination.copy_(source)

    with monkeypatch.context() as patched:
        patched.setattr(torch, "_foreach_copy_", copy_then_fail)
        with pytest.raises(RuntimeError, match="device error"):
            writer.write((7,), synthetic_adapter(8, PROJECTIONS, seed=2))  # A rows copied, Bs not
    again = synthetic_adapter(4, ("q_proj",), seed=3)  # the shape the page last held whole
    writer.write((7,), again).wait()

    assert_pages_hold_exactly(model, (7,), again)


def test_a_write_into_the_wrong_number_of_pages_is_refused(model: CausalLM):
    with pytest.raises(ValueError, match="rank 20 cannot take pages"):
        SlotWriter(model).write((1,), synthetic_adapter(20, PROJECTIONS, seed=1))


@pytest.mark.parametrize("rank", [16, 8, 40])  # one page exactly, one page padded, three pages
def test_adapters_of_one_layout_share_cached_source_views_and_each_lands_whole(model: CausalLM, rank: int):
    writer = SlotWriter(model)
    first = synthetic_adapter(rank, PROJECTIONS, seed=1, gap=2)
    # the same layout (files saved alike), other weights
    second = HostAdapter("adapter-other", rank, 3.0, torch.randn_like(first.buffer), first.parts)
    assert second.layout == first.layout

    writer.write(pages_for(model, rank), first).wait()
    writer.write(pages_for(model, rank, UNTOUCHED + NEIGHBOUR), second).wait()
    writer.write(pages_for(model, rank), second).wait()

    assert_pages_hold_exactly(model, pages_for(model, rank), second)
    assert_pages_hold_exactly(model, pages_for(model, rank, UNTOUCHED + NEIGHBOUR), second)
