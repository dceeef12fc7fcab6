"""FP8 serving through the whole engine, built as a worker builds it (--quantization fp8,
--kv-cache-dtype fp8 in EngineConfig, the residency's memory plan and loader)."""

from __future__ import annotations

import torch

from kernels.quant import FP8_DTYPE
from shared.schema import JobStatus
from tests.engine.fp8_oracle import fp8_oracle
from tests.engine.test_engine_generation import NEW_TOKENS, PROMPTS, greedy_request, make_engine, run_to_completion
from tests.engine.tiny_hf import TinyCheckpoint, oracle_greedy


def test_the_fp8_engine_generates_the_quantized_oracles_greedy_tokens(llama: TinyCheckpoint):
    engine = make_engine(llama, quantization="fp8")
    assert engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    oracle = fp8_oracle(llama.oracle)
    for job_id, adapter in jobs.items():
        assert results[job_id].status is JobStatus.SUCCEEDED, results[job_id].error
        assert list(results[job_id].output.token_ids) == oracle_greedy(oracle, PROMPTS[adapter], adapter, NEW_TOKENS)


def test_an_fp8_kv_cache_holds_twice_the_blocks_of_the_same_bytes(llama: TinyCheckpoint):
    auto = make_engine(llama, num_kv_blocks=None, cpu_kv_cache_gb=0.001)
    fp8 = make_engine(llama, num_kv_blocks=None, cpu_kv_cache_gb=0.001, kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.key[0].dtype == FP8_DTYPE and auto.runner.kv_cache.key[0].dtype == torch.float32
    # float32 activations on CPU: an fp8 cache is a quarter of the bytes per block
    assert fp8.runner.num_blocks // 4 == auto.runner.num_blocks  # the same bytes, floored
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(fp8, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert all(result.status is JobStatus.SUCCEEDED and len(result.output.token_ids) == NEW_TOKENS
               for result in results.values())  # fmt: skip
