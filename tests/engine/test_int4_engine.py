"""4-bit (W4A16) serving through the whole engine, built as a worker builds it (--quantization int4
in EngineConfig, the residency's memory plan and loader): on CPU, and on the GPU with the Triton
GEMM, CUDA-graph decode and every adapter, against the dequantized oracle (tests/engine/int4_oracle.py).
The tiny llama's widths (64, 96) quantize at load in groups of 32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.quant.int4_mma import TINYGEMM_MAX_TOKENS
from shared.schema import JobStatus
from tests.engine.int4_oracle import INT4_SHAPE, int4_oracle
from tests.engine.test_engine_generation import (
    NEW_TOKENS,
    PROMPTS,
    greedy_request,
    make_engine,
    prefill_logits,
    run_to_completion,
)
from tests.engine.tiny_hf import TinyCheckpoint, build_checkpoint, oracle_greedy, oracle_logits
from tests.kernels.lora_cases import rel_err
from worker.model.lora_linear import LoRALinear

GROUP = 32  # the largest of 128, 64, 32 that divides 64 and 96


def assert_greedy_matches_the_int4_oracle(llama: TinyCheckpoint, **engine: object) -> None:
    engine_ = make_engine(llama, quantization="int4", **engine)
    assert engine_.runner.model.info.weight_group_size == GROUP
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine_, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    oracle = int4_oracle(llama.oracle, GROUP)
    for job_id, adapter in jobs.items():
        assert results[job_id].status is JobStatus.SUCCEEDED, results[job_id].error
        assert list(results[job_id].output.token_ids) == oracle_greedy(oracle, PROMPTS[adapter], adapter, NEW_TOKENS)


def test_the_int4_engine_generates_the_dequantized_oracles_greedy_tokens(llama: TinyCheckpoint):
    assert_greedy_matches_the_int4_oracle(llama)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_float32_int4_engine_on_the_gpu_generates_the_oracles_greedy_tokens(llama: TinyCheckpoint):
    """The Triton GEMM in float32 (ieee products), decode steps replayed from CUDA graphs."""
    assert_greedy_matches_the_int4_oracle(llama, device="cuda", dtype="float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bf16_int4_engine_on_the_gpu_matches_the_int4_engine_on_cpu(llama: TinyCheckpoint):
    """The same 4-bit weights, in bf16 on the GPU against float32 on CPU: within the bf16 engine's
    tolerance of its fp32 run (2e-2; tests/engine/test_engine_gpu.py): the dequantized weights are
    rounded to bf16 on the GPU, as any bf16 weight is."""
    on_gpu = prefill_logits(llama, PROMPTS, device="cuda", dtype="bfloat16", quantization="int4")
    on_cpu = prefill_logits(llama, PROMPTS, device="cpu", dtype="float32", quantization="int4")
    assert rel_err(on_gpu, on_cpu) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_the_gpu_serves_few_rows_from_the_tensor_core_copy_within_bf16_of_the_oracle(tmp_path: Path):
    """A bf16 engine on CUDA keeps a tensor-core copy of the affine 4-bit weights of a model whose
    widths fit it (whole 128-input word groups; kernels/quant/int4_mma.py), filled once loaded. A batch
    of prompts (the Triton kernels on the k-major weights) and one prompt of TINYGEMM_MAX_TOKENS
    tokens (tinygemm on the copy) match the dequantized float32 oracle within the bf16 tolerance
    above: scale and offset rounded to bf16 move a weight by no more than rounding the weight itself
    does. The engine's decode steps replay tinygemm from CUDA graphs as they start."""
    wide = build_checkpoint("llama", tmp_path, **INT4_SHAPE)
    runner = make_engine(wide, device="cuda", dtype="bfloat16", quantization="int4").runner
    layers = [module for module in runner.model.modules() if isinstance(module, LoRALinear)]
    assert layers and all(layer.decode_qweight is not None for layer in layers)
    oracle = int4_oracle(wide.oracle, 128)
    short = {None: PROMPTS[None][:TINYGEMM_MAX_TOKENS]}
    for prompts in (PROMPTS, short):
        expected = torch.stack([oracle_logits(oracle, prompt, None)[-1] for prompt in prompts.values()])
        on_gpu = prefill_logits(wide, prompts, device="cuda", dtype="bfloat16", quantization="int4")
        assert rel_err(on_gpu, expected) < 2e-2
