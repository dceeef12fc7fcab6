"""bench/e2e's stage split: the stack's requests from their job records' traces, the engine alone's from
its results' stamps, and the table that sets them side by side."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from bench.e2e.client import Sample
from bench.e2e.stages import engine_points, stack_points, stage_rows
from shared.schema import JobStatus, JobTrace
from worker.engine.engine_request import EngineResult

START = 1_700_000_000.0  # the run's start, unix s


def stack_sample(index: int) -> Sample:
    at = index * 0.1
    return Sample(index, None, at, sent_s=at, first_token_s=at + 0.020, end_s=at + 0.050, status="succeeded",
                  completion_tokens=4, job_id=f"job{index}")  # fmt: skip


def trace_of(index: int) -> JobTrace:
    """Created 1 ms after the planned arrival, then 1 ms to the read, 1 to start, 1 into the engine, 10 to the
    first token, 30 to the last, 2 out; the client reads the end 4 ms later."""
    at = START + index * 0.1
    offsets_ms = (1, 2, 3, 4, 14, 44, 46)
    return JobTrace(*(round((at + ms / 1000) * 1e6) for ms in offsets_ms))


def test_the_stacks_stages_are_the_gaps_between_its_trace_points_and_add_up_to_its_latency():
    samples = [stack_sample(i) for i in range(5)]
    traces = {f"job{i}": trace_of(i) for i in range(5)}
    traces["job4"] = replace(trace_of(4), out=0)  # not a complete trace: left out
    points = stack_points(samples, traces, START)
    assert len(points) == 4

    alone_samples = [Sample(i, None, i * 0.1, first_token_s=i * 0.1 + 0.012, end_s=i * 0.1 + 0.043,
                            status="succeeded", completion_tokens=4) for i in range(4)]  # fmt: skip
    results = {
        i: EngineResult(f"{i}", JobStatus.SUCCEEDED, completion_tokens=4, added_at=START + i * 0.1 + 0.002,
                        first_token_at=START + i * 0.1 + 0.012, finished_at=START + i * 0.1 + 0.042)
        for i in range(4)
    }  # fmt: skip
    rows = {row.name.split(" (")[0]: row for row in stage_rows(points, engine_points(alone_samples, results, START))}

    stack_ms = [row.stack_p50_ms for row in list(rows.values())[:8]]
    assert stack_ms == pytest.approx([1, 1, 1, 1, 10, 30, 2, 4], abs=1e-3)
    assert sum(stack_ms) == pytest.approx(rows["latency: arrival → end"].stack_p50_ms, abs=1e-3)
    assert rows["started → in the engine"].alone_p50_ms == pytest.approx(2, abs=1e-3)  # arrival → in the engine
    assert rows["latency: arrival → end"].added_p50_ms == pytest.approx(50 - 43, abs=1e-3)
    assert rows["read → started"].alone_p50_ms == 0  # the engine alone has no such stage
    assert rows["first token: engine → client"].stack_p50_ms == pytest.approx(20 - 14, abs=1e-3)


def test_a_run_without_complete_requests_gives_nan_not_an_error():
    rows = stage_rows([], [])
    assert all(math.isnan(row.stack_p50_ms) and math.isnan(row.alone_mean_ms) for row in rows)
