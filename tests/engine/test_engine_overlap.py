"""The engine's CPU/GPU overlap: step N+1 is launched before step N's tokens are read, taking them on
the device as stand-ins; a sequence that step N ends discards its row of step N+1. On CPU the same
code runs (the copies are just synchronous), so these tests pin its bookkeeping down."""

from __future__ import annotations

import dataclasses

import pytest

from shared.schema import FinishReason, JobStatus
from tests.engine.test_engine_generation import (
    NEW_TOKENS,
    PROMPTS,
    assert_matches_oracle,
    expected_tokens,
    greedy_request,
    make_engine,
    preload_adapters,
    run_to_completion,
)
from tests.engine.tiny_hf import TinyCheckpoint
from worker.engine.engine import LLMEngine
from worker.engine.sampled_tokens import SampledTokens


def record_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Log ("execute", {seq_id: newest token id as the runner saw it}) per launch and ("read", None)
    per host read of a step's tokens, in the order they happen."""
    events: list[tuple[str, object]] = []
    execute = engine.runner.execute

    def logged_execute(scheduled, *args):
        events.append(("execute", {item.seq.seq_id: item.seq.output_token_ids[-1:] for item in scheduled}))
        return execute(scheduled, *args)

    wait = SampledTokens.wait

    def logged_wait(self):
        events.append(("read", None))
        return wait(self)

    monkeypatch.setattr(engine.runner, "execute", logged_execute)
    monkeypatch.setattr(SampledTokens, "wait", logged_wait)
    return events


def test_the_next_step_is_launched_before_this_ones_tokens_are_read(llama: TinyCheckpoint, monkeypatch):
    engine = make_engine(llama)
    preload_adapters(engine, llama)  # no step without a launch while an adapter is still being read
    events = record_steps(engine, monkeypatch)
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert_matches_oracle(llama, results, jobs)
    kinds = [kind for kind, _ in events]
    # every launch after the first precedes the read of the step before it
    launches = kinds.count("execute")
    assert kinds == ["execute"] + ["execute", "read"] * (launches - 1) + ["read"]
    # a sequence's newest token, as the next step takes it, is a stand-in id < 0: still on the device
    newest = [tokens for kind, step in events if kind == "execute" for tokens in step.values() if tokens]
    assert newest and all(tokens[0] < 0 for tokens in newest)


def test_a_sequence_at_its_length_limit_is_not_scheduled_again(llama: TinyCheckpoint, monkeypatch):
    engine = make_engine(llama)
    events = record_steps(engine, monkeypatch)
    results = run_to_completion(engine, [greedy_request(llama, "one", None)])
    assert list(results["one"].output.token_ids) == expected_tokens(llama, None)
    # one prefill and NEW_TOKENS - 1 decodes: the step that samples the last token is the last step
    assert sum(kind == "execute" for kind, _ in events) == NEW_TOKENS


def test_a_stop_token_discards_the_row_already_launched_after_it(llama: TinyCheckpoint):
    engine = make_engine(llama)
    expected = expected_tokens(llama, None)
    stop_at = 2
    # the third greedy token is declared end-of-sequence (a token not earlier in the output)
    assert expected[stop_at] not in expected[:stop_at]
    engine.info = dataclasses.replace(engine.info, eos_token_ids=(expected[stop_at],))
    request = greedy_request(llama, "eos", None)
    request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, ignore_eos=False))
    results = run_to_completion(engine, [request, greedy_request(llama, "other", "all_r8")])
    stopped = results["eos"]
    assert stopped.status is JobStatus.SUCCEEDED
    assert stopped.output.finish_reason is FinishReason.STOP
    assert list(stopped.output.token_ids) == expected[: stop_at + 1]
    assert stopped.completion_tokens == stop_at + 1
    assert list(results["other"].output.token_ids) == expected_tokens(llama, "all_r8")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_abort_between_launch_and_read_discards_the_step(llama: TinyCheckpoint):
    engine = make_engine(llama)
    run_to_completion(engine, [])  # nothing: the engine is idle
    engine.add(greedy_request(llama, "gone", None))
    engine.add(greedy_request(llama, "kept", None))
    assert engine.step() == []  # the prefill is launched, its tokens not read yet
    assert engine.abort("gone")
    results = run_to_completion(engine, [])
    assert set(results) == {"kept"}
    assert list(results["kept"].output.token_ids) == expected_tokens(llama, None)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_sequence_preempted_with_its_token_in_flight_is_recomputed_from_the_device_copy(
    llama: TinyCheckpoint, monkeypatch
):
    engine = make_engine(llama)
    recomputed_stand_ins = []
    execute = engine.runner.execute

    def logged_execute(scheduled, *args):
        for item in scheduled:
            seq = item.seq
            tokens = seq.token_ids(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens)
            if item.num_new_tokens > 1 and min(tokens) < 0:
                recomputed_stand_ins.append(seq.seq_id)
        return execute(scheduled, *args)

    monkeypatch.setattr(engine.runner, "execute", logged_execute)
    engine.add(greedy_request(llama, "p", None))
    engine.step()  # the prefill is launched
    engine.step()  # the first decode is launched, the prefill's token read
    [seq] = engine.scheduler.running
    assert seq.output_token_ids[-1] < 0  # the first decode's token: not read yet
    engine.scheduler.preempt(seq)  # as when the next step's schedule runs out of KV blocks
    results = run_to_completion(engine, [])
    assert recomputed_stand_ins == ["p"]  # the recompute's prompt ended in the stand-in, taken on the device
    assert list(results["p"].output.token_ids) == expected_tokens(llama, None)
