"""An engine started without LoRA (--max-loras 0), built as a worker builds it: no LoRA memory and no
adapter pool, the same tokens as an engine with LoRA for base-model requests, and a request naming an
adapter refused with its code while the others go on."""

from __future__ import annotations

import pytest
import torch

from shared.errors import ErrorCode
from shared.schema import JobStatus, SamplingParams
from tests.engine.test_engine_generation import (
    NEW_TOKENS,
    PROMPTS,
    assert_matches_oracle,
    greedy_request,
    make_engine,
    run_to_completion,
)
from tests.engine.tiny_hf import TinyCheckpoint
from worker.engine.engine_request import EngineRequest

# base-model requests of several lengths, so steps mix prefill chunks and decodes
BASE_REQUESTS = {f"base-{index}": prompt for index, prompt in enumerate(PROMPTS.values())}


def base_requests() -> list[EngineRequest]:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [EngineRequest(job_id, tuple(prompt), sampling) for job_id, prompt in BASE_REQUESTS.items()]


def test_base_requests_give_the_same_greedy_tokens_with_lora_off_as_on(llama: TinyCheckpoint):
    def tokens(max_loras: int) -> dict[str, tuple[int, ...]]:
        engine = make_engine(llama, max_loras=max_loras, max_num_batched_tokens=16)
        results = run_to_completion(engine, base_requests())
        assert all(r.status is JobStatus.SUCCEEDED for r in results.values())
        return {job_id: r.output.token_ids for job_id, r in results.items()}

    assert tokens(0) == tokens(8)
    engine = make_engine(llama, max_loras=0)
    assert_matches_oracle(llama, run_to_completion(engine, [greedy_request(llama, "oracle", None)]), {"oracle": None})


def test_an_engine_without_lora_holds_no_lora_memory_and_no_adapter_pool(llama: TinyCheckpoint):
    engine = make_engine(llama, max_loras=0)
    model = engine.runner.model
    lora_tensors = [b for name, b in model.named_buffers() if "lora" in name or "slot_" in name]
    assert len(lora_tensors) > 3  # the slot tables, and each projection's A and B
    assert not model.lora_enabled and sum(t.nbytes for t in lora_tensors) == 0
    assert engine.adapter_pool is None and engine.adapter_slots.num_pages == 0


def test_a_request_naming_an_adapter_is_refused_with_its_code_and_the_rest_go_on(llama: TinyCheckpoint):
    engine = make_engine(llama, max_loras=0)
    results = run_to_completion(engine, [greedy_request(llama, "adapted", "all_r8"), *base_requests()])

    refused = results["adapted"]
    assert refused.status is JobStatus.FAILED and refused.error.code == ErrorCode.ADAPTER_EXCEEDS_MODEL_LIMITS
    assert "runs without LoRA (--max-loras 0)" in refused.error.message
    assert all(results[job_id].status is JobStatus.SUCCEEDED for job_id in BASE_REQUESTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_engine_without_lora_captures_only_base_graphs(llama: TinyCheckpoint):
    engine = make_engine(llama, device="cuda", dtype="float32", max_loras=0, max_num_seqs=8)
    graphs, piecewise = engine.runner.graphs, engine.runner.piecewise
    variants = {with_lora for _, with_lora in [*graphs._graphs, *piecewise._graphs]}
    assert variants == {False}
    results = run_to_completion(engine, [greedy_request(llama, "oracle", None)])
    assert_matches_oracle(llama, results, {"oracle": None})
