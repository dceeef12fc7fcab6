"""PEFT adapters read from disk and written into (and over) the model's adapter slots by the adapter
pool's reader and slot writer, as a worker loads them."""

from __future__ import annotations

import math

import pytest
import torch

from shared.errors import ErrorCode, LorafleetError
from tests.engine.engine_driver import BlockPool, PagedSequence, make_kv_cache, prefill
from tests.engine.engines import host_adapter, load_model
from tests.engine.tiny_hf import ADAPTERS, TinyCheckpoint
from worker.adapter_pool.slot_writer import SlotWriter
from worker.model.model import CausalLM

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2]]


def logits_in_slot(model: CausalLM, slot: int) -> torch.Tensor:
    """Last-token logits of PROMPTS, every token routed to `slot`, on a fresh cache."""
    seqs = [PagedSequence(list(prompt), slot=slot) for prompt in PROMPTS]
    return prefill(seqs, model, make_kv_cache(model, num_blocks=16, block_size=4), BlockPool(16))


def slot_weights(model: CausalLM, slot: int) -> list[torch.Tensor]:
    """Every LoRA matrix stored in `slot`, padding included (kernels may not mask past the rank)."""
    return [
        stacked[slot]
        for layer in model.model.layers
        for linear in layer.lora_linears()
        for stacked in (*linear.lora_a, *linear.lora_b)
    ]


# the old adapter has a higher rank and touches every projection the new one leaves alone
@pytest.mark.parametrize(("slot", "old", "new"), [(1, "all_r8", "attn_r4_rslora"), (0, "all_r8", "mlp_k_r4")])
def test_a_slot_written_over_another_adapter_gives_exactly_the_new_adapters_logits(
    llama: TinyCheckpoint, slot: int, old: str, new: str
) -> None:
    model = load_model(llama.model_dir, llama.info)
    writer = SlotWriter(model)
    writer.write((slot,), host_adapter(llama.adapters[old], model)).wait()
    old_logits = logits_in_slot(model, slot)

    writer.write((slot,), host_adapter(llama.adapters[new], model)).wait()
    fresh = load_model(llama.model_dir, llama.info, {slot: llama.adapters[new]})

    assert torch.equal(logits_in_slot(model, slot), logits_in_slot(fresh, slot))
    assert not torch.allclose(logits_in_slot(model, slot), old_logits)
    assert all(torch.equal(a, b) for a, b in zip(slot_weights(model, slot), slot_weights(fresh, slot), strict=True))


def test_a_read_adapter_carries_rank_scaling_and_only_the_targeted_projections(llama: TinyCheckpoint) -> None:
    spec = ADAPTERS["attn_r4_rslora"]
    model = load_model(llama.model_dir, llama.info)

    adapter = host_adapter(llama.adapters["attn_r4_rslora"], model)

    assert adapter.rank == 4
    assert adapter.scaling == pytest.approx(spec["alpha"] / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)
    parts = {(part.layer, part.projection): part for part in adapter.parts}
    assert set(parts) == {(layer, p) for layer in range(llama.info.num_layers) for p in spec["targets"]}
    o_proj = parts[(1, "o_proj")]
    assert adapter.a(o_proj).shape == (4, llama.info.num_heads * llama.info.head_dim)
    assert adapter.b(o_proj).shape == (llama.info.hidden_size, 4)


def test_writing_a_slot_records_its_rank_and_scale(llama: TinyCheckpoint) -> None:
    model = load_model(llama.model_dir, llama.info, {3: llama.adapters["mlp_k_r4"]})

    assert model.slot_ranks.tolist() == [0, 0, 0, 4]
    assert model.slot_scales[3].item() == pytest.approx(ADAPTERS["mlp_k_r4"]["alpha"] / 4)


def test_an_adapter_over_the_pools_rank_is_refused_when_read(llama: TinyCheckpoint) -> None:
    model = load_model(llama.model_dir, llama.info, max_lora_rank=4)

    with pytest.raises(LorafleetError, match="rank 8 exceeds the maximum rank 4") as refused:
        host_adapter(llama.adapters["all_r8"], model)

    assert refused.value.code == ErrorCode.ADAPTER_LOAD_FAILED


def test_an_adapter_over_the_slot_rank_is_refused_by_the_writer(llama: TinyCheckpoint) -> None:
    model = load_model(llama.model_dir, llama.info, max_lora_rank=4)
    adapter = host_adapter(llama.adapters["all_r8"], model, max_rank=8)  # read for a larger pool

    with pytest.raises(ValueError, match="adapter rank 8 exceeds max_lora_rank 4"):
        SlotWriter(model).write((0,), adapter)
