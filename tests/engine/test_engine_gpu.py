"""The engine on a CUDA GPU (Triton attention, GPU sampling) against transformers + PEFT and the CPU path."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig, ModelSpec
from tests.engine.test_engine_generation import (
    PROMPTS,
    assert_matches_oracle,
    greedy_request,
    make_engine,
    run_to_completion,
)
from tests.engine.tiny_hf import TinyCheckpoint
from tests.kernels.lora_cases import rel_err
from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("budget", [2048, 5])
def test_fp32_greedy_tokens_equal_the_oracle(llama: TinyCheckpoint, budget: int):
    engine = make_engine(llama, device="cuda", dtype="float32", max_num_batched_tokens=budget)
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert_matches_oracle(llama, results, jobs)


def test_bf16_prefill_logits_are_within_bf16_tolerance_of_fp32_cpu(llama: TinyCheckpoint):
    def prefill_logits(device: str, dtype: str) -> torch.Tensor:
        config = EngineConfig(device=device, dtype=dtype, max_lora_rank=8, num_kv_blocks=64, block_size=4)
        runner = ModelRunner(ModelSpec(llama.family, llama.model_dir), config)
        blocks = BlockManager(runner.num_blocks, config.block_size)
        scheduled = []
        for name, prompt in PROMPTS.items():
            seq = Sequence(seq_id=str(name), prompt_token_ids=prompt, sampling=None, seed=0)
            blocks.allocate(seq, len(prompt))
            scheduled.append(ScheduledSequence(seq, len(prompt)))
        return runner.execute(scheduled, lambda uid: None, config.block_size).cpu()

    assert rel_err(prefill_logits("cuda", "bfloat16"), prefill_logits("cpu", "float32")) < 2e-2
