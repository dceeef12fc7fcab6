"""bitsandbytes NF4 serving through the whole engine, built as a worker builds it (the residency's
memory plan and loader reading a double-quantized NF4 checkpoint): on CPU, and on the GPU with the
Triton GEMM's codebook dequantization, CUDA-graph decode and every adapter, against the oracle over
the dequantized checkpoint (tests/engine/nf4_oracle.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.schema import JobStatus
from tests.engine.int4_oracle import INT4_SHAPE
from tests.engine.nf4_oracle import bnb_oracle, save_bnb_checkpoint
from tests.engine.test_engine_generation import NEW_TOKENS, PROMPTS, greedy_request, make_engine, run_to_completion
from tests.engine.tiny_hf import TinyCheckpoint, build_checkpoint, oracle_greedy


@pytest.fixture(scope="module")
def nf4_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """The tiny llama in whole 64-input blocks saved as a double-quantized NF4 checkpoint (QLoRA's
    settings), its adapters, and the oracle over its dequantized weights."""
    plain = build_checkpoint("llama", tmp_path_factory.mktemp("nf4_engine"), **INT4_SHAPE)
    model_dir = save_bnb_checkpoint(plain.model_dir, plain.model_dir.parent / "nf4", double_quant=True)
    return dataclasses.replace(plain, model_dir=model_dir, oracle=bnb_oracle(plain.oracle, model_dir))


def assert_greedy_matches_the_nf4_oracle(checkpoint: TinyCheckpoint, **engine: object) -> None:
    engine_ = make_engine(checkpoint, **engine)
    assert engine_.runner.model.info.quantization == "nf4"
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine_, [greedy_request(checkpoint, job, adapter) for job, adapter in jobs.items()])
    for job_id, adapter in jobs.items():
        assert results[job_id].status is JobStatus.SUCCEEDED, results[job_id].error
        expected = oracle_greedy(checkpoint.oracle, PROMPTS[adapter], adapter, NEW_TOKENS)
        assert list(results[job_id].output.token_ids) == expected


def test_the_nf4_engine_generates_the_dequantized_oracles_greedy_tokens(nf4_llama: TinyCheckpoint):
    assert_greedy_matches_the_nf4_oracle(nf4_llama)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_float32_nf4_engine_on_the_gpu_generates_the_oracles_greedy_tokens(nf4_llama: TinyCheckpoint):
    """The Triton GEMM's codebook path in float32 (ieee products), decode steps replayed from CUDA graphs."""
    assert_greedy_matches_the_nf4_oracle(nf4_llama, device="cuda", dtype="float32")
