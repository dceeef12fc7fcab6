"""bench/e2e's arithmetic: a run's row from its samples, the worker's counters differenced from real
Prometheus text, and the targets' verdicts."""

from __future__ import annotations

import math
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.e2e.client import Sample
from bench.e2e.floor import adapter_floor, expected_distinct
from bench.e2e.summary import JobTimes, summarize, table, verdicts, worker_table
from bench.e2e.traffic import zipf_weights
from bench.e2e.worker_metrics import Snapshot, WorkerStats, difference


def sample(index: int, at: float, ttft: float, latency: float, tokens: int = 8, status: str = "succeeded") -> Sample:
    return Sample(index, None, at, sent_s=at, accepted_s=at + 0.001, first_token_s=at + ttft, end_s=at + latency,
                  status=status, completion_tokens=tokens, job_id=f"job{index}")  # fmt: skip


def test_a_rows_throughput_latencies_and_failures_come_from_its_samples():
    samples = [sample(i, i * 0.1, ttft=0.05 + 0.01 * i, latency=0.5) for i in range(10)]
    samples.append(Sample(10, None, 1.0, sent_s=1.0, status="http_429", end_s=1.0))
    times = {
        f"job{i}": JobTimes(created_ms=1000, started_ms=1003, first_token_ms=1040, finished_ms=1400) for i in range(10)
    }
    row = summarize("load", "base", 10.0, samples, start_unix_s=0.0, job_times=times)
    assert (row.requests, row.failed, row.failures) == (11, 1, {"http_429": 1})
    # 80 tokens from the first arrival (0.0 s) to the last end (0.9 + 0.5 s)
    assert math.isclose(row.output_tok_s, 80 / 1.4)
    assert math.isclose(row.ttft_p50_ms, 95.0) and row.ttft_p99_ms > 135.0
    assert math.isclose(row.latency_p50_ms, 500.0)
    assert row.queue_p50_ms == 3.0 and row.server_ttft_p50_ms == 40.0


def test_every_table_has_as_many_columns_in_its_rows_as_in_its_header():
    worker = WorkerStats(10, 8.0, 8.0, 8.0, 2.0, 800, 90.0, 1, 5.0, 0, 1.0, 0.01)
    row = summarize("load", "zipf", 10.0, [sample(0, 0.0, ttft=0.05, latency=0.5)], worker=worker)
    for rendered in (table([row], output_tokens=8), worker_table([row])):
        header, separator, *rows = rendered.splitlines()
        columns = header.count("|")
        assert separator.count("|") == columns and all(line.count("|") == columns for line in rows), rendered


def test_a_records_whole_ms_stamps_count_from_the_middle_of_their_millisecond():
    # sent 0.3 ms into millisecond 1000, stored within it: the gateway's truncated stamp reads 1000
    samples = [sample(0, 1.0003, ttft=0.01, latency=0.0507)]
    times = {"job0": JobTimes(created_ms=1000, started_ms=1000, first_token_ms=1010, finished_ms=1050)}
    row = summarize("load", "base", 1.0, samples, start_unix_s=0.0, job_times=times)
    assert math.isclose(row.submit_p50_ms, 0.2, abs_tol=1e-6)  # 1000.5 - 1000.3, not -0.3
    assert math.isclose(row.delivery_p50_ms, 0.5, abs_tol=1e-6)  # read at 1051.0, stored in ms 1050


def test_worker_counters_are_differenced_between_two_scrapes():
    registry = CollectorRegistry()
    steps = Histogram("lorafleet_worker_step_seconds", "", ["model"], registry=registry)
    hits = Counter("lorafleet_worker_adapter_hits", "", ["model", "tier"], registry=registry)
    misses = Counter("lorafleet_worker_adapter_misses", "", ["model", "tier"], registry=registry)

    def snapshot() -> Snapshot:
        families = text_string_to_metric_families(generate_latest(registry).decode())
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}

    steps.labels("m").observe(1.0)
    hits.labels("m", "gpu").inc(5)
    before = snapshot()
    for _ in range(4):
        steps.labels("m").observe(0.02)
    hits.labels("m", "gpu").inc(3)
    hits.labels("m", "cpu").inc(7)  # another tier: not a GPU hit
    misses.labels("m", "gpu").inc(1)
    stats = difference(before, snapshot())
    assert stats.steps == 4 and math.isclose(stats.step_ms, 20.0)
    assert stats.adapter_loads == 1 and math.isclose(stats.adapter_gpu_hit_pct, 75.0)


def test_the_ttft_target_looks_at_zipf_where_base_last_kept_the_objective():
    template = summarize("load", "base", 1.0, [sample(0, 0.0, 0.1, 1.0)])
    rows = [
        replace(template, mode="base", offered_rps=10.0, output_tok_s=1000.0, ttft_p99_ms=200.0),
        replace(template, mode="base", offered_rps=20.0, output_tok_s=2000.0, ttft_p99_ms=900.0),
        replace(template, mode="zipf", offered_rps=10.0, output_tok_s=1000.0, ttft_p99_ms=300.0),
        replace(template, mode="zipf", offered_rps=20.0, output_tok_s=1500.0, ttft_p99_ms=4000.0),
    ]
    saturation, ttft, failures, overhead = verdicts(rows, {"base": 25.0, "zipf": 15.0}, None, 0.85, None)
    assert saturation.met is None  # no calibration rows
    assert ttft.met is False and "zipf p99 4000 ms" in ttft.measured  # base kept 1 s up to 20 req/s
    assert failures.met is True and "in 3 runs" in failures.measured  # zipf at 20 req/s is past its saturation
    assert overhead.met is None


def test_the_overhead_target_sets_the_stacks_step_time_beside_the_engine_alones():
    template = summarize("load", "base", 10.0, [sample(0, 0.0, 0.1, 1.0)])

    def steps(count: int, step_ms: float, idle_ms: float) -> WorkerStats:
        return WorkerStats(count, step_ms, 8.0, 8.0, 0.0, 800, math.nan, 0, math.nan, 0, 1.0, idle_ms)

    stack = replace(template, latency_p50_ms=112.0, worker=steps(100, 14.0, 0.25))
    alone = replace(template, phase="engine-alone", latency_p50_ms=100.0, worker=steps(98, 13.0, 0.125))
    overhead = verdicts([stack, alone], {}, (stack, alone), 0.85, None)[-1]
    assert overhead.met is False and "= 12.0 ms" in overhead.measured
    assert "mean step 14.00 ms over 100 steps (stack) vs 13.00 ms over 98 (engine alone)" in overhead.measured
    assert "waiting for the host, 0.250 vs 0.125 ms a step" in overhead.measured


def test_the_saturation_target_is_the_calibrations_ratio_with_its_byte_floor_beside_it():
    template = summarize("calibration", "base", 0.0, [sample(0, 0.0, 0.1, 1.0)])
    rows = [replace(template, output_tok_s=1000.0), replace(template, mode="zipf", output_tok_s=870.0)]
    weights = zipf_weights(100, 1.0)
    floor = adapter_floor(weights, 128.0, 84_000_000, 3.0e12, base_step_ms=14.0)
    saturation = verdicts(rows, {}, None, 0.85, floor)[0]
    assert saturation.met is True and "= 0.87×" in saturation.measured
    assert "byte floor 0.91×" in saturation.measured  # the figures: ~48 distinct, ~1.3 ms


def test_expected_distinct_adapters_of_a_zipf_batch():
    assert math.isclose(expected_distinct([0.5, 0.5], 1), 1.0)
    assert math.isclose(expected_distinct([0.5, 0.5], 2), 1.5)
    assert 47 < expected_distinct(zipf_weights(100, 1.0), 128) < 50
    assert 70 < expected_distinct(zipf_weights(1000, 1.0), 128) < 80
