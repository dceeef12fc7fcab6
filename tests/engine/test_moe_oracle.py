"""MoE models (Qwen3-MoE, Mixtral) with per-expert adapters: the engine's logits against
transformers + PEFT in float32, over a batch mixing adapters and the base model; the adapter pool's
slot writes of expert LoRAs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig, ModelSpec
from shared.schema import JobStatus, SamplingParams
from tests.engine.engine_driver import BlockPool, PagedSequence, build_step, load_engine, make_kv_cache, prefill
from tests.engine.test_engine_generation import run_to_completion, word_tokenizer
from tests.engine.tiny_hf import oracle_greedy, oracle_logits, saved_adapter_ref
from tests.engine.tiny_moe import FUSED, MOE_FAMILIES, VOCAB_SIZE, TinyMoE, build_tiny_moe
from worker.adapter_pool.host_adapter import HostAdapter, read_host_adapter
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.model import CausalLM
from worker.engine.model_runner import ModelRunner
from worker.engine.peft_adapter import load_adapter_weights

TOLERANCE = 1e-4
NEW_TOKENS = 6
NEAR_TIE = 1e-2  # top-two logit gap under which GPU fp32 (tf32 dots) may pick the other token
SLOTS = {"experts_r8": 1, "experts_only_r4": 3, "attn_r4": 0, FUSED: 2}
MIXED = [(None, 6), ("experts_r8", 5), ("experts_only_r4", 9), (FUSED, 7), ("attn_r4", 3), ("experts_r8", 1), (None, 4)]


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyMoE:
    return build_tiny_moe(request.param, Path(tmp_path_factory.mktemp(request.param)))


def _sequences() -> list[tuple[str | None, PagedSequence]]:
    seqs = []
    for seed, (adapter, length) in enumerate(MIXED):
        tokens = torch.randint(0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
        seqs.append((adapter, PagedSequence(tokens, slot=-1 if adapter is None else SLOTS[adapter])))
    return seqs


def _engine(tiny_moe: TinyMoE):
    adapters = {slot: tiny_moe.adapters[name] for name, slot in SLOTS.items()}
    return load_engine(tiny_moe.model_dir, tiny_moe.info, adapters)


def test_mixed_batch_matches_hf(tiny_moe: TinyMoE) -> None:
    model = _engine(tiny_moe)
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)
    seqs = _sequences()
    logits = prefill([seq for _, seq in seqs], model, kv_cache, BlockPool(64))
    for row, (adapter, seq) in enumerate(seqs):
        expected = oracle_logits(tiny_moe.oracle, seq.token_ids, adapter)[-1]
        assert (logits[row] - expected).abs().max() <= TOLERANCE, f"sequence {row} ({adapter})"
        if adapter is not None:  # the adapter matters, so the comparison can fail
            base = oracle_logits(tiny_moe.oracle, seq.token_ids, None)[-1]
            assert (expected - base).abs().max() > 100 * TOLERANCE


def test_decode_steps_match_hf(tiny_moe: TinyMoE) -> None:
    model = _engine(tiny_moe)
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)
    pool = BlockPool(64, seed=1)
    seqs = _sequences()[:5]
    next_tokens = prefill([seq for _, seq in seqs], model, kv_cache, pool).argmax(-1).tolist()
    for _ in range(3):
        for (_, seq), token in zip(seqs, next_tokens, strict=True):
            seq.token_ids.append(token)
        logits = model(build_step([(seq, 1) for _, seq in seqs], model, kv_cache, pool), kv_cache)
        for row, (adapter, seq) in enumerate(seqs):
            expected = oracle_logits(tiny_moe.oracle, seq.token_ids, adapter)[-1]
            assert (logits[row] - expected).abs().max() <= TOLERANCE
        next_tokens = logits.argmax(-1).tolist()


def test_adapter_pool_writes_expert_slots_as_set_adapter_slot_does_and_leaks_nothing(tiny_moe: TinyMoE) -> None:
    """The serving path (host adapter → slot writer) against the direct copy, after the slot held a
    higher-rank adapter on the same experts."""

    def host(name: str) -> HostAdapter:
        directory = tiny_moe.adapters[name]
        ref = saved_adapter_ref(name, directory)
        return read_host_adapter(ref, adapter_root=directory.parent, info=tiny_moe.info, dtype=torch.float32,
                                 max_rank=8, max_bytes=1 << 30, pin=False)  # fmt: skip

    served = CausalLM(tiny_moe.info, max_loras=2, max_lora_rank=8, dtype=torch.float32)
    writer = SlotWriter(served)
    writer.write((1,), host("experts_r8")).wait()
    writer.write((1,), host("experts_only_r4")).wait()
    direct = CausalLM(tiny_moe.info, max_loras=2, max_lora_rank=8, dtype=torch.float32)
    weights = load_adapter_weights(tiny_moe.adapters["experts_only_r4"], tiny_moe.info, max_rank=8, max_bytes=1 << 30)
    direct.set_adapter_slot(1, weights)

    expert_buffers = 0
    for (name, got), (_, want) in zip(served.named_buffers(), direct.named_buffers(), strict=True):
        assert torch.equal(got, want), name
        expert_buffers += ".mlp.lora_" in name
    assert expert_buffers == 4 * len(tiny_moe.info.moe_layers)


def test_adapter_pool_serves_peft_fused_expert_loras_at_their_doubled_rank(tiny_moe: TinyMoE) -> None:
    """PEFT's fused form: gate_up at rank 2r takes the slot at that rank, attention zero-padded to it;
    every LoRA buffer as the direct copy (which keeps attention at r) fills it."""
    directory = tiny_moe.adapters[FUSED]
    ref = saved_adapter_ref(FUSED, directory)
    host = read_host_adapter(ref, adapter_root=directory.parent, info=tiny_moe.info, dtype=torch.float32,
                             max_rank=8, max_bytes=1 << 30, pin=False)  # fmt: skip
    served = CausalLM(tiny_moe.info, max_loras=2, max_lora_rank=8, dtype=torch.float32)
    SlotWriter(served).write((0,), host).wait()
    direct = CausalLM(tiny_moe.info, max_loras=2, max_lora_rank=8, dtype=torch.float32)
    direct.set_adapter_slot(0, load_adapter_weights(directory, tiny_moe.info, max_rank=8, max_bytes=1 << 30))

    assert host.rank == 8 and served.slot_ranks[0] == 8  # r = 4, gate_up 2r
    for (name, got), (_, want) in zip(served.named_buffers(), direct.named_buffers(), strict=True):
        if "lora" in name:
            assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_engine_decodes_the_oracles_greedy_tokens(tiny_moe: TinyMoE) -> None:
    """The serving path on CUDA in float32: the fused MoE and MoE-LoRA kernels, the dense LoRA
    deltas added by RoPE / SiLU·up / the residual (Qwen3's before its q/k norm), the expert LoRA
    beside the grouped GEMMs, decode steps in CUDA graphs; every adapter and the base model in one
    batch give transformers + PEFT's greedy tokens, up to a near-tie of the oracle's."""
    config = EngineConfig(device="cuda", dtype="float32", max_loras=4, max_lora_rank=8, num_kv_blocks=64, block_size=4)
    runner = ModelRunner(ModelSpec(tiny_moe.family, tiny_moe.model_dir), config)
    engine = LLMEngine(runner, word_tokenizer(), config, next(iter(tiny_moe.adapters.values())).parent)
    requests, jobs = [], {}
    for index, ((adapter, _), (_, seq)) in enumerate(zip(MIXED, _sequences(), strict=True)):
        ref = None
        if adapter is not None:
            directory = tiny_moe.adapters[adapter]
            ref = saved_adapter_ref(adapter, directory)
        sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        requests.append(EngineRequest(f"job-{index}", tuple(seq.token_ids), sampling, adapter=ref))
        jobs[f"job-{index}"] = (adapter, seq.token_ids)
    results = run_to_completion(engine, requests)
    for job_id, (adapter, prompt) in jobs.items():
        result = results[job_id]
        assert result.status is JobStatus.SUCCEEDED, result.error
        got, want = list(result.output.token_ids), oracle_greedy(tiny_moe.oracle, prompt, adapter, NEW_TOKENS)
        diverged = next((k for k in range(NEW_TOKENS) if got[k] != want[k]), None)
        if diverged is not None:
            # the expert kernels' fp32 dots round as tf32 does: tokens may part only at a near-tie
            # (mixtral's job-1 at its third token, whose top two logits the oracle puts 3e-4 apart)
            top2 = oracle_logits(tiny_moe.oracle, prompt + want[:diverged], adapter)[-1].topk(2).values
            assert top2[0] - top2[1] < NEAR_TIE, (job_id, got, want)
