"""The worker's memory plan, computed on the CPU from model shapes and given device bytes: what fits on
an 80 GB GPU, every budget line, and an error naming the setting to turn for what does not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.moe import QWEN3_30B_A3B
from bench.random_engine import LLAMA3_8B
from shared.config import EngineConfig
from shared.model_info import ModelInfo
from worker.memory_plan import DeviceMemory, MemoryPlanError, model_footprint, plan_memory
from worker.model.kv_cache import KVLayout
from worker.model.model import CausalLM

GB = 10**9
H100 = DeviceMemory(total=80 * GB, free=79 * GB)  # a fresh process's view: the CUDA context took the rest
CUDA = EngineConfig(device="cuda")  # the worker's defaults: 8 adapters of rank 64, 2048 tokens a step
TINY_MOE = dataclasses.replace(
    QWEN3_30B_A3B, name="tiny-moe", hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=300, num_experts=6, num_experts_per_tok=2,
    moe_intermediate_size=32, moe_layers=(1, 2),
)  # fmt: skip


def plan_one(info: ModelInfo, config: EngineConfig = CUDA, memory: DeviceMemory = H100):
    return plan_memory({info.name: info}, config, memory=memory)


def test_llama_3_8b_fits_an_80_gb_gpu_with_a_kv_cache_the_rest_of_its_memory():
    plan = plan_one(LLAMA3_8B)

    footprint = plan.footprints[LLAMA3_8B.name]
    assert 16 * GB < footprint.weights < 16.1 * GB  # bf16: 8.03B parameters
    assert footprint.expert_lora == 0
    blocks = plan.kv_blocks(LLAMA3_8B.name)
    assert blocks * footprint.kv_bytes_per_block > 40 * GB
    spent = footprint.fixed + plan.kv_storage_bytes
    assert spent <= plan.usable_bytes == int(79 * GB - 0.1 * 80 * GB)


def test_qwen3_30b_a3b_with_8_expert_lora_slots_of_rank_64_does_not_fit_80_gb_and_the_error_names_the_knobs():
    with pytest.raises(MemoryPlanError) as refused:
        plan_one(QWEN3_30B_A3B)

    message = str(refused.value)
    assert "--max-loras 8 adapters of --max-lora-rank 64" in message
    assert "every expert's slots take 62.81 GB" in message  # 8 slots x 48 layers x 128 experts at rank 64
    assert message.index("--max-loras") < message.index("--max-num-batched-tokens")  # the LoRA pool first


def test_qwen3_30b_a3b_fits_80_gb_with_fewer_lower_rank_adapters_and_a_kv_cache():
    config = dataclasses.replace(CUDA, max_loras=2, max_lora_rank=16)

    plan = plan_one(QWEN3_30B_A3B, config)

    footprint = plan.footprints[QWEN3_30B_A3B.name]
    assert 3.9 * GB < footprint.expert_lora < 4 * GB
    assert plan.kv_blocks(QWEN3_30B_A3B.name) > 100
    assert footprint.fixed + plan.kv_storage_bytes <= plan.usable_bytes


def test_the_same_model_fits_a_141_gb_gpu_at_the_worker_defaults():
    h200 = DeviceMemory(total=141 * GB, free=140 * GB)

    plan = plan_one(QWEN3_30B_A3B, dataclasses.replace(CUDA, max_lora_rank=32), h200)

    assert plan.kv_blocks(QWEN3_30B_A3B.name) > 1000


@pytest.mark.parametrize("info", [LLAMA3_8B, TINY_MOE], ids=["dense", "moe"])
def test_the_footprint_counts_every_tensor_the_model_allocates(info: ModelInfo):
    small = dataclasses.replace(info, num_layers=2, moe_layers=tuple(i for i in info.moe_layers if i < 2))
    if not info.is_moe:
        small = dataclasses.replace(small, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                                    head_dim=16, vocab_size=300)  # fmt: skip
    config = EngineConfig(device="cpu", dtype="bfloat16", max_loras=3, max_lora_rank=24)
    model = CausalLM(small, max_loras=3, max_lora_rank=24, dtype=torch.bfloat16)  # allocated, on the CPU
    tensors = {t.data_ptr(): t.nbytes for t in (*model.parameters(), *model.buffers())}

    footprint = model_footprint(small, config)

    assert footprint.weights + footprint.dense_lora + footprint.expert_lora == sum(tensors.values())
    assert (footprint.expert_lora > 0) == info.is_moe


@pytest.mark.parametrize("info", [LLAMA3_8B, QWEN3_30B_A3B], ids=["dense", "moe"])
def test_a_worker_without_lora_counts_no_lora_memory_and_gives_it_to_the_kv_cache(info: ModelInfo):
    with_lora = dataclasses.replace(CUDA, max_loras=1, max_lora_rank=16)  # small enough for the MoE model to fit
    without = dataclasses.replace(with_lora, max_loras=0)

    lora, base = plan_one(info, with_lora), plan_one(info, without)

    footprint = base.footprints[info.name]
    assert footprint.dense_lora == footprint.expert_lora == footprint.lora_staging == 0
    assert footprint.weights == lora.footprints[info.name].weights
    assert footprint.activations < lora.footprints[info.name].activations  # no LoRA deltas
    assert base.kv_blocks(info.name) > lora.kv_blocks(info.name)


def test_activations_grow_with_the_tokens_one_step_may_process():
    small, large = (
        model_footprint(LLAMA3_8B, dataclasses.replace(CUDA, max_num_batched_tokens=t)) for t in (512, 8192)
    )
    assert large.activations > 2 * small.activations
    assert small.weights == large.weights


def test_too_many_batched_tokens_fail_naming_that_setting_first():
    with pytest.raises(MemoryPlanError, match=r"Lower --max-num-batched-tokens, --max-loras"):
        plan_one(LLAMA3_8B, dataclasses.replace(CUDA, max_loras=1, max_lora_rank=8, max_num_batched_tokens=400_000))


def test_a_given_number_of_kv_blocks_is_exact_and_fails_when_it_does_not_fit():
    plan = plan_one(LLAMA3_8B, dataclasses.replace(CUDA, num_kv_blocks=1000))
    per_block = KVLayout.of(LLAMA3_8B, 16, torch.bfloat16).bytes_per_block
    assert plan.kv_blocks(LLAMA3_8B.name) == 1000
    assert plan.kv_storage_bytes == 1001 * per_block  # and the decode graphs' padding block

    with pytest.raises(MemoryPlanError, match="--num-kv-blocks 100000 needs"):
        plan_one(LLAMA3_8B, dataclasses.replace(CUDA, num_kv_blocks=100_000))


def test_the_kv_cache_stops_at_what_a_full_batch_of_full_contexts_can_use():
    plan = plan_one(LLAMA3_8B, dataclasses.replace(CUDA, max_num_seqs=4))
    assert plan.kv_blocks(LLAMA3_8B.name) == 4 * LLAMA3_8B.max_context // 16


def test_no_room_for_a_single_kv_block_names_the_settings_that_make_room():
    needs = plan_one(LLAMA3_8B).footprints[LLAMA3_8B.name].fixed
    tight = DeviceMemory(total=100 * GB, free=needs + (1 << 30) + int(0.1 * 100 * GB) + 1000)  # all but KV

    with pytest.raises(MemoryPlanError, match="no memory is left for llama-3-8b-random's KV cache"):
        plan_one(LLAMA3_8B, memory=tight)


def test_a_memory_fraction_caps_the_plan_below_what_the_device_has_free():
    shared = DeviceMemory(total=80 * GB, free=70 * GB, allocated=2 * GB)
    config = dataclasses.replace(CUDA, gpu_memory_fraction=0.45)

    assert plan_one(LLAMA3_8B, config, shared).usable_bytes == int(0.45 * 80 * GB) - 2 * GB
    with pytest.raises(MemoryPlanError, match=r"--gpu-memory-fraction 0\.3"):
        plan_one(LLAMA3_8B, dataclasses.replace(config, gpu_memory_fraction=0.3), shared)


def test_several_models_keep_as_many_resident_as_fit_and_room_to_prepare_another():
    infos = {name: dataclasses.replace(LLAMA3_8B, name=name) for name in ("a", "b", "c")}

    plan = plan_memory(infos, CUDA, memory=H100)

    fixed = plan.footprints["a"].fixed
    assert plan.resident_slots == 1  # two and the reserve for the third exceed 75% of the memory
    assert plan.kv_storage_bytes == plan.usable_bytes - (1 << 30) - 2 * fixed  # the resident one and the reserve


def test_a_cpu_worker_splits_its_kv_budget_among_resident_models():
    infos = {name: dataclasses.replace(TINY_MOE, name=name) for name in ("a", "b")}
    config = EngineConfig(device="cpu", cpu_kv_cache_gb=0.5)

    plan = plan_memory(infos, config, memory=None)

    assert plan.resident_slots == 2 and plan.usable_bytes is None
    assert plan.kv_storage_bytes <= (1 << 29) // 2
    assert plan.kv_blocks("a") >= 1
