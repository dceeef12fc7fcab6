"""A two-rank engine on two GPUs (NCCL, decode and piecewise graphs with their all-reduces captured)
against the one-GPU engine: fp32 greedy tokens equal (and the transformers + PEFT oracle's), bf16
logits within bf16 tolerance, dense and MoE, adapters in a mixed batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.engines import tensor_parallel_engine
from tests.engine.test_engine_generation import (
    PROMPTS,
    assert_matches_oracle,
    greedy_request,
    make_engine,
    run_to_completion,
)
from tests.engine.test_tensor_parallel import DENSE_ADAPTERS, MOE_ADAPTERS, one_and_two_ranks
from tests.engine.tiny_hf import TinyCheckpoint
from tests.engine.tiny_moe import build_tiny_moe
from tests.kernels.lora_cases import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_fp32_greedy_tokens_at_two_ranks_equal_one_gpu_and_the_oracle(llama: TinyCheckpoint):
    jobs = {f"job-{name}": name for name in PROMPTS}

    def requests() -> list:
        return [greedy_request(llama, job, adapter) for job, adapter in jobs.items()]

    # make_engine's settings, with few decode graphs to capture (two ranks capture them at once)
    settings = {"max_lora_rank": 8, "num_kv_blocks": 64, "block_size": 4, "device": "cuda", "dtype": "float32"}
    settings["max_num_seqs"] = 8
    single = run_to_completion(make_engine(llama, **settings), requests())
    root = next(iter(llama.adapters.values())).parent
    with tensor_parallel_engine(llama.model_dir, root, name=llama.family, tensor_parallel=2, **settings) as engine:
        parallel = run_to_completion(engine, requests())
    assert {job: r.output.token_ids for job, r in parallel.items()} == {
        job: r.output.token_ids for job, r in single.items()
    }
    assert_matches_oracle(llama, parallel, jobs)


def test_bf16_dense_logits_at_two_ranks_are_within_bf16_tolerance_of_one_gpu(llama: TinyCheckpoint):
    expected, got = one_and_two_ranks(llama.model_dir, llama.adapters, DENSE_ADAPTERS, device="cuda", dtype="bfloat16")
    for want, have in zip(expected, got, strict=True):
        assert rel_err(have, want) < 2e-2


def test_bf16_moe_logits_at_two_ranks_are_within_bf16_tolerance_of_one_gpu(tmp_path: Path):
    moe = build_tiny_moe("qwen3_moe", tmp_path)
    expected, got = one_and_two_ranks(moe.model_dir, moe.adapters, MOE_ADAPTERS, device="cuda", dtype="bfloat16")
    for want, have in zip(expected, got, strict=True):
        assert rel_err(have, want) < 2e-2
