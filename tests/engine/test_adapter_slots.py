"""PEFT adapters loaded from disk and copied into (and evicted from) the model's adapter slots."""

from __future__ import annotations

import math

import pytest
import torch

from shared.errors import ErrorCode, LorafleetError
from tests.engine.engine_driver import BlockPool, PagedSequence, load_engine, make_kv_cache, prefill
from tests.engine.tiny_hf import ADAPTERS, TinyCheckpoint
from worker.adapter_pool.peft_adapter import load_adapter_weights
from worker.model.model import CausalLM

LIMITS = {"max_rank": 8, "max_bytes": 1 << 30}  # validation limits for load_adapter_weights
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2]]


def logits_in_slot(model: CausalLM, slot: int) -> torch.Tensor:
    """Last-token logits of PROMPTS, every token routed to `slot`, on a fresh cache."""
    seqs = [PagedSequence(list(prompt), slot=slot) for prompt in PROMPTS]
    return prefill(seqs, model, make_kv_cache(model, num_blocks=16, block_size=4), BlockPool(16))


def base_logits(model: CausalLM) -> torch.Tensor:
    return logits_in_slot(model, -1)


def slot_weights(model: CausalLM, slot: int) -> list[torch.Tensor]:
    """Every LoRA matrix stored in `slot`, padding included (kernels may not mask past the rank)."""
    return [
        stacked[slot]
        for layer in model.model.layers
        for linear in layer.lora_linears()
        for stacked in (*linear.lora_a, *linear.lora_b)
    ]


def test_an_evicted_slot_gives_exactly_the_new_adapters_logits(llama: TinyCheckpoint) -> None:
    # the old adapter has a higher rank and touches every projection the new one leaves alone
    model = load_engine(llama.model_dir, llama.info, {1: llama.adapters["all_r8"]})
    old_logits = logits_in_slot(model, 1)

    model.clear_adapter_slot(1)
    model.set_adapter_slot(1, load_adapter_weights(llama.adapters["attn_r4_rslora"], llama.info, **LIMITS))
    fresh = load_engine(llama.model_dir, llama.info, {1: llama.adapters["attn_r4_rslora"]})

    assert torch.equal(logits_in_slot(model, 1), logits_in_slot(fresh, 1))
    assert not torch.allclose(logits_in_slot(model, 1), old_logits)
    assert all(torch.equal(now, new) for now, new in zip(slot_weights(model, 1), slot_weights(fresh, 1), strict=True))


def test_setting_a_slot_over_another_adapter_replaces_it_entirely(llama: TinyCheckpoint) -> None:
    model = load_engine(llama.model_dir, llama.info, {0: llama.adapters["all_r8"]})

    model.set_adapter_slot(0, load_adapter_weights(llama.adapters["mlp_k_r4"], llama.info, **LIMITS))
    fresh = load_engine(llama.model_dir, llama.info, {0: llama.adapters["mlp_k_r4"]})

    assert torch.equal(logits_in_slot(model, 0), logits_in_slot(fresh, 0))
    assert all(torch.equal(now, new) for now, new in zip(slot_weights(model, 0), slot_weights(fresh, 0), strict=True))


def test_a_cleared_slot_gives_exactly_the_base_models_logits(llama: TinyCheckpoint) -> None:
    model = load_engine(llama.model_dir, llama.info, {2: llama.adapters["all_r8"]})

    model.clear_adapter_slot(2)

    assert torch.equal(logits_in_slot(model, 2), base_logits(model))
    assert not any(weights.any() for weights in slot_weights(model, 2))
    assert model.slot_ranks[2] == 0 and model.slot_scales[2] == 0


def test_adapter_weights_carry_rank_scaling_and_only_the_targeted_projections(llama: TinyCheckpoint) -> None:
    spec = ADAPTERS["attn_r4_rslora"]

    adapter = load_adapter_weights(llama.adapters["attn_r4_rslora"], llama.info, **LIMITS)

    assert adapter.rank == 4
    assert adapter.scaling == pytest.approx(spec["alpha"] / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)
    assert set(adapter.lora) == {(layer, p) for layer in range(llama.info.num_layers) for p in spec["targets"]}
    a, b = adapter.lora[(1, "o_proj")]
    assert a.shape == (4, llama.info.num_heads * llama.info.head_dim) and b.shape == (llama.info.hidden_size, 4)


def test_setting_a_slot_records_its_rank_and_scale(llama: TinyCheckpoint) -> None:
    model = load_engine(llama.model_dir, llama.info, {3: llama.adapters["mlp_k_r4"]})

    assert model.slot_ranks.tolist() == [0, 0, 0, 4]
    assert model.slot_scales[3].item() == pytest.approx(ADAPTERS["mlp_k_r4"]["alpha"] / 4)


def test_an_adapter_over_the_pool_rank_is_refused_by_validation(llama: TinyCheckpoint) -> None:
    with pytest.raises(LorafleetError) as refused:
        load_adapter_weights(llama.adapters["all_r8"], llama.info, max_rank=4, max_bytes=1 << 30)

    assert refused.value.code == ErrorCode.ADAPTER_RANK_TOO_LARGE


def test_an_adapter_over_the_slot_rank_is_refused(llama: TinyCheckpoint) -> None:
    model = load_engine(llama.model_dir, llama.info, {}, max_lora_rank=4)
    adapter = load_adapter_weights(llama.adapters["all_r8"], llama.info, **LIMITS)

    with pytest.raises(ValueError, match="adapter rank 8 exceeds max_lora_rank 4"):
        model.set_adapter_slot(0, adapter)


def test_a_slot_outside_the_pool_is_refused(llama: TinyCheckpoint) -> None:
    model = load_engine(llama.model_dir, llama.info, {}, max_loras=2)

    with pytest.raises(ValueError, match=r"slot 2 is outside 0\.\.1"):
        model.clear_adapter_slot(2)
