"""The whole engine (scheduler + model runner + adapter slots) against transformers + PEFT."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from shared.adapter_format import WEIGHTS_FILE
from shared.errors import ErrorCode
from shared.schema import AdapterRef, FinishReason, JobStatus, SamplingParams
from tests.engine.engines import load_engine
from tests.engine.tiny_hf import VOCAB_SIZE, TinyCheckpoint, oracle_greedy, saved_adapter_ref
from worker.engine.block_manager import BlockManager
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest, EngineResult
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence
from worker.metrics import WorkerMetrics

PROMPTS = {
    None: [5, 17, 42, 7, 99, 3, 250, 11, 64],
    "all_r8": [8, 9, 10, 11, 12, 13, 14],
    "attn_r4_rslora": [200, 3, 77, 150, 21, 9, 9, 1, 40, 33, 120, 60],
    "mlp_k_r4": [1, 2, 3],
}
NEW_TOKENS = 6


def make_engine(
    checkpoint: TinyCheckpoint,
    adapter_root: Path | None = None,
    *,
    metrics: WorkerMetrics | None = None,
    **engine_overrides: object,
) -> LLMEngine:
    settings = {"device": "cpu", "max_lora_rank": 8, "num_kv_blocks": 64, "block_size": 4, **engine_overrides}
    adapter_root = adapter_root or next(iter(checkpoint.adapters.values())).parent
    return load_engine(checkpoint.model_dir, adapter_root, name=checkpoint.family, metrics=metrics, **settings)


def adapter_ref(checkpoint: TinyCheckpoint, name: str) -> AdapterRef:
    return saved_adapter_ref(name, checkpoint.adapters[name])


def preload_adapters(engine: LLMEngine, checkpoint: TinyCheckpoint) -> None:
    """Every adapter of PROMPTS on the host before the first step: a test whose assertions depend on
    which requests run in which step must not race the pool's disk reads (a loaded machine finishes
    them a step or more later)."""
    engine.adapter_pool.preload([adapter_ref(checkpoint, name) for name in PROMPTS if name is not None])


def greedy_request(checkpoint: TinyCheckpoint, job_id: str, adapter: str | None, **sampling: object) -> EngineRequest:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **sampling)
    return EngineRequest(
        job_id=job_id,
        prompt_token_ids=tuple(PROMPTS[adapter]),
        sampling=params,
        adapter=None if adapter is None else adapter_ref(checkpoint, adapter),
    )


def prefill_logits(checkpoint: TinyCheckpoint, prompts: dict[str | None, list[int]], **engine: object) -> torch.Tensor:
    """float32 [len(prompts), vocab] on the CPU: the logits after each prompt, all prefilled in one step
    without adapters by a runner built as make_engine builds it with `engine`'s settings."""
    runner = make_engine(checkpoint, **engine).runner
    blocks = BlockManager(runner.num_blocks, runner.config.block_size)
    scheduled = []
    for name, prompt in prompts.items():
        seq = Sequence(seq_id=str(name), prompt_token_ids=prompt, sampling=None, seed=0)
        blocks.allocate(seq, len(prompt))
        scheduled.append(ScheduledSequence(seq, len(prompt)))
    return runner.execute(scheduled, lambda uid: None, runner.config.block_size).float().cpu()


def run_to_completion(
    engine: LLMEngine, requests: list[EngineRequest], max_steps: int = 500
) -> dict[str, EngineResult]:
    results: dict[str, EngineResult] = {}
    for request in requests:
        immediate = engine.add(request)
        if immediate is not None:
            results[request.job_id] = immediate
    for _ in range(max_steps):
        if not engine.num_unfinished:
            break
        results.update((r.job_id, r) for r in engine.step())
    assert not engine.num_unfinished, "engine did not finish its requests"
    return results


def expected_tokens(checkpoint: TinyCheckpoint, adapter: str | None) -> list[int]:
    return oracle_greedy(checkpoint.oracle, PROMPTS[adapter], adapter, NEW_TOKENS)


def assert_matches_oracle(checkpoint: TinyCheckpoint, results: dict[str, EngineResult], jobs: dict[str, str | None]):
    for job_id, adapter in jobs.items():
        result = results[job_id]
        assert result.status is JobStatus.SUCCEEDED, result.error
        assert list(result.output.token_ids) == expected_tokens(checkpoint, adapter), (job_id, adapter)
        assert result.output.finish_reason is FinishReason.LENGTH


def test_mixed_adapter_batch_matches_transformers_peft_greedy(llama: TinyCheckpoint):
    engine = make_engine(llama)
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert_matches_oracle(llama, results, jobs)


def test_chunked_prefill_and_preemption_do_not_change_outputs(llama: TinyCheckpoint):
    # 9 blocks of 4 tokens cannot hold all four sequences at full length: some are preempted and
    # recomputed; a budget of 5 tokens a step splits every prompt into chunks.
    engine = make_engine(llama, num_kv_blocks=9, max_num_batched_tokens=5)
    preload_adapters(engine, llama)  # so all four contend for the blocks from the first step
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert engine.scheduler.num_preemptions > 0
    assert_matches_oracle(llama, results, jobs)


def test_more_adapters_than_slots_are_served_by_eviction(llama: TinyCheckpoint):
    engine = make_engine(llama, max_loras=1)
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert_matches_oracle(llama, results, jobs)
    assert engine.adapter_slots.resident == [adapter_ref(llama, "mlp_k_r4").uid]


def test_same_seed_gives_the_same_sample_whatever_the_batch(llama: TinyCheckpoint):
    def sampled(job_id: str) -> EngineRequest:
        params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
        return EngineRequest(job_id=job_id, prompt_token_ids=tuple(PROMPTS[None]), sampling=params)

    alone = run_to_completion(make_engine(llama), [sampled("a")])["a"]
    crowd = [greedy_request(llama, f"g-{name}", name) for name in PROMPTS]
    together = run_to_completion(make_engine(llama), [*crowd, sampled("a")])["a"]
    assert alone.output.token_ids == together.output.token_ids


def test_adapter_whose_files_changed_fails_only_its_own_jobs(llama: TinyCheckpoint, tmp_path: Path):
    for name, directory in llama.adapters.items():
        shutil.copytree(directory, tmp_path / name)
    engine = make_engine(llama, tmp_path)
    stale = greedy_request(llama, "stale", "all_r8")
    (tmp_path / "all_r8" / WEIGHTS_FILE).write_bytes(b"tampered")
    results = run_to_completion(engine, [stale, greedy_request(llama, "fine", "mlp_k_r4")])
    assert results["stale"].status is JobStatus.FAILED
    assert results["stale"].error.code == ErrorCode.ADAPTER_LOAD_FAILED
    assert results["fine"].status is JobStatus.SUCCEEDED


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        ((), ErrorCode.EMPTY_PROMPT),
        ((VOCAB_SIZE,), ErrorCode.INVALID_TOKEN_ID),
        ((1,) * 5000, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
    ],
)
def test_requests_that_can_never_run_fail_at_once(llama: TinyCheckpoint, prompt: tuple[int, ...], code: ErrorCode):
    engine = make_engine(llama)
    result = engine.add(EngineRequest(job_id="bad", prompt_token_ids=prompt, sampling=SamplingParams()))
    assert result is not None and result.status is JobStatus.FAILED and result.error.code == code
    assert not engine.num_unfinished


def test_abort_frees_the_sequence(llama: TinyCheckpoint):
    engine = make_engine(llama)
    engine.add(greedy_request(llama, "x", "all_r8"))
    while not engine.scheduler.running:  # the first steps wait for the adapter to load
        engine.step()
    free_before = engine.blocks.num_free_blocks
    assert engine.abort("x")
    assert engine.blocks.num_free_blocks > free_before
    assert not engine.num_unfinished and engine.step() == []


def test_out_of_memory_step_is_retried_with_a_smaller_batch(llama: TinyCheckpoint, monkeypatch):
    engine = make_engine(llama)
    execute = engine.runner.execute
    too_big = []

    def execute_fitting_two(scheduled, *args):
        if len(scheduled) > 2:  # the device "holds" at most two sequences a step
            too_big.append(len(scheduled))
            raise torch.OutOfMemoryError("injected")
        return execute(scheduled, *args)

    monkeypatch.setattr(engine.runner, "execute", execute_fitting_two)
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert too_big, "the injected out-of-memory never happened"
    assert_matches_oracle(llama, results, jobs)


def test_request_that_does_not_fit_alone_fails_and_the_engine_goes_on(llama: TinyCheckpoint, monkeypatch):
    engine = make_engine(llama)
    execute = engine.runner.execute

    def execute_without_room_for_the_long_prompt(scheduled, *args):
        if any(item.seq.seq_id == "huge" for item in scheduled):
            raise torch.OutOfMemoryError("injected")
        return execute(scheduled, *args)

    monkeypatch.setattr(engine.runner, "execute", execute_without_room_for_the_long_prompt)
    huge = greedy_request(llama, "huge", "attn_r4_rslora")
    results = run_to_completion(engine, [huge, greedy_request(llama, "fine", None)])
    assert results["huge"].status is JobStatus.FAILED
    assert results["huge"].error.code == ErrorCode.OUT_OF_MEMORY
    assert list(results["fine"].output.token_ids) == expected_tokens(llama, None)


def test_request_past_its_deadline_expires_and_frees_its_blocks(llama: TinyCheckpoint):
    engine = make_engine(llama)
    overdue = EngineRequest(
        job_id="late",
        prompt_token_ids=tuple(PROMPTS[None]),
        sampling=SamplingParams(max_tokens=50, ignore_eos=True),
        deadline=time.time() - 1,
    )
    results = run_to_completion(engine, [overdue, greedy_request(llama, "on-time", None)])
    assert results["late"].status is JobStatus.EXPIRED
    assert results["late"].error.code == ErrorCode.DEADLINE_EXCEEDED
    assert results["on-time"].status is JobStatus.SUCCEEDED
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_non_finite_logits_fail_only_that_request(llama: TinyCheckpoint, monkeypatch):
    engine = make_engine(llama)
    execute = engine.runner.execute

    def poison_the_nan_request(scheduled, *args):
        logits = execute(scheduled, *args).clone()  # an inference tensor cannot be edited in place
        for row, item in enumerate(scheduled):
            if item.seq.seq_id == "nan":
                logits[row, 0] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", poison_the_nan_request)
    results = run_to_completion(engine, [greedy_request(llama, "nan", "all_r8"), greedy_request(llama, "ok", "all_r8")])
    assert results["nan"].status is JobStatus.FAILED
    assert results["nan"].error.code == ErrorCode.NUMERICAL_ERROR
    assert list(results["ok"].output.token_ids) == expected_tokens(llama, "all_r8")
