"""The slot writer's fast path (views built once per slot and adapter shape, sources cut by one split)
writes exactly the adapter and zeroes everything else of the slot, whatever the slot held before."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.model_info import PROJECTIONS, ModelInfo
from worker.adapter_pool.host_adapter import AdapterPart, BufferLayout, HostAdapter
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.model import CausalLM

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
SLOTS = 3


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


def slot_matrices(model: CausalLM, slot: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) → (A [max_rank, in], B [out, max_rank]) of `slot`, copied."""
    return {
        (index, name): (a[slot].clone(), b[slot].clone())
        for index, layer in enumerate(model.model.layers)
        for linear in layer.lora_linears()
        for name, a, b in zip(linear.projections, linear.lora_a, linear.lora_b, strict=True)
    }


def assert_slot_holds_exactly(model: CausalLM, slot: int, adapter: HostAdapter) -> None:
    """The adapter's ranks in its projections, zeros everywhere else of the slot."""
    parts = {(part.layer, part.projection): part for part in adapter.parts}
    rank = adapter.rank
    for key, (a, b) in slot_matrices(model, slot).items():
        part = parts.get(key)
        if part is None:
            assert not a.any() and not b.any(), f"{key} is untargeted but not zero"
            continue
        assert torch.equal(a[:rank], adapter.a(part)), key
        assert torch.equal(b[:, :rank], adapter.b(part)), key
        assert not a[rank:].any() and not b[:, rank:].any(), f"{key} holds entries past rank {rank}"
    assert model.slot_ranks[slot] == rank
    assert model.slot_scales[slot] == adapter.scaling


@pytest.fixture
def model() -> CausalLM:
    """Every slot filled with nonzero entries, as if written by other means before the writer."""
    model = CausalLM(INFO, max_loras=SLOTS, max_lora_rank=MAX_RANK, dtype=torch.float32)
    for layer in model.model.layers:
        for linear in layer.lora_linears():
            for slots in (*linear.lora_a, *linear.lora_b):
                slots.fill_(1.0)
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
    writer.write(0, neighbour).wait()
    untouched = slot_matrices(model, 2)

    for adapter in sequence:
        writer.write(1, adapter).wait()
        assert_slot_holds_exactly(model, 1, adapter)
    assert_slot_holds_exactly(model, 0, neighbour)
    assert all(
        torch.equal(a, a2) and torch.equal(b, b2)
        for (a, b), (a2, b2) in zip(untouched.values(), slot_matrices(model, 2).values(), strict=True)
    )


def test_a_lower_rank_adapter_leaves_zeros_past_its_rank_in_every_projection(model: CausalLM):
    writer = SlotWriter(model)
    writer.write(1, synthetic_adapter(64, PROJECTIONS, seed=1)).wait()
    lower = synthetic_adapter(16, PROJECTIONS, seed=2)

    writer.write(1, lower).wait()

    for key, (a, b) in slot_matrices(model, 1).items():
        assert not a[16:].any() and not b[:, 16:].any(), key
    assert_slot_holds_exactly(model, 1, lower)


def test_the_writer_keeps_a_bounded_number_of_slot_plans(model: CausalLM):
    writer = SlotWriter(model)
    for rank in range(1, MAX_RANK + 1):
        for slot in range(SLOTS):
            writer.write(slot, synthetic_adapter(rank, PROJECTIONS, seed=rank)).wait()
    assert writer.bookkeeping_size() <= 4 * SLOTS
    assert_slot_holds_exactly(model, 2, synthetic_adapter(MAX_RANK, PROJECTIONS, seed=MAX_RANK))


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


def test_a_write_that_fails_midway_leaves_the_slot_to_be_zeroed_by_the_next(model: CausalLM, monkeypatch):
    writer = SlotWriter(model)
    small = synthetic_adapter(4, ("q_proj",), seed=1)
    writer.write(1, small).wait()
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
            writer.write(1, synthetic_adapter(8, PROJECTIONS, seed=2))  # A rows copied, Bs not
    again = synthetic_adapter(4, ("q_proj",), seed=3)  # the shape the slot last held whole
    writer.write(1, again).wait()

    assert_slot_holds_exactly(model, 1, again)
