"""FP8 serving through the whole engine, built as a worker builds it (--quantization fp8,
--kv-cache-dtype fp8 in EngineConfig, the residency's memory plan and loader)."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import FP8_DTYPE
from shared.schema import JobStatus
from tests.engine.fp8_oracle import fp8_oracle
from tests.engine.test_engine_generation import NEW_TOKENS, PROMPTS, greedy_request, make_engine, run_to_completion
from tests.engine.tiny_hf import TinyCheckpoint, oracle_greedy
from tests.kernels.lora_cases import rel_err
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("kv_cache_dtype", "tolerance"), [("auto", 2e-2), ("fp8", 6e-2)])
def test_the_fp8_engine_on_the_gpu_matches_the_fp8_engine_on_cpu(
    llama: TinyCheckpoint, kv_cache_dtype: str, tolerance: float
):
    """torch._scaled_mm, the Triton quantization and (fp8 KV) the cache kernels in bf16 against the
    CPU reference path in float32: within the bf16 engine's tolerance of its fp32 run (2e-2), and with
    an fp8 cache (unscaled e4m3 on both sides, K/V rounded from different bf16/fp32 values) within
    three times that. The CPU side quantizes its KV the same way, so fp8's own error cancels."""

    def prefill_logits(device: str, dtype: str) -> torch.Tensor:
        runner = make_engine(
            llama, device=device, dtype=dtype, quantization="fp8", kv_cache_dtype=kv_cache_dtype
        ).runner
        blocks = BlockManager(runner.num_blocks, runner.config.block_size)
        scheduled = []
        for name, prompt in PROMPTS.items():
            seq = Sequence(seq_id=str(name), prompt_token_ids=prompt, sampling=None, seed=0)
            blocks.allocate(seq, len(prompt))
            scheduled.append(ScheduledSequence(seq, len(prompt)))
        return runner.execute(scheduled, lambda uid: None, runner.config.block_size).cpu()

    assert rel_err(prefill_logits("cuda", "bfloat16"), prefill_logits("cpu", "float32")) < tolerance
