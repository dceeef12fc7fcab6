"""A real worker process serves its Prometheus metrics over HTTP (`--metrics-port`): after jobs of a
base model and an adapter ran, the text exposition shows their tokens and batches, an empty KV
cache, the jobs started by arrival and adapter tier, and (on this CPU worker) no GPU series."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.redis_server import free_port
from shared import keys
from shared.schema import JobTrace
from tests.e2e.processes import wait_until
from tests.fleet import MODEL, Fleet, jobs_for
from worker.metrics import JOB_STAGES

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_worker_serves_its_engine_metrics_over_http(fleet: Fleet):
    port = free_port()
    fleet.start_gateway()
    fleet.start_worker("w1", "--metrics-port", str(port))
    model = (("model", MODEL),)
    before = scrape(port)
    assert before[("lorafleet_worker_generated_tokens_total", model)] == 0
    assert before[("lorafleet_worker_kv_blocks_total", model)] > 0

    jobs = jobs_for(4, max_tokens=5)
    job_ids = fleet.submit(jobs)
    records = fleet.wait_finished(job_ids, timeout_s=120)
    generated = sum(record.completion_tokens for record in records)
    assert generated == 4 * 5

    # the last step's numbers are recorded right after its results are handed over: allow a moment
    wait_until(
        lambda: scrape(port)[("lorafleet_worker_generated_tokens_total", model)] == generated,
        timeout_s=10,
        what="the worker's metrics to count every generated token",
        logs=fleet.logs,
    )
    after = scrape(port)
    assert after[("lorafleet_worker_batch_size_count", model)] >= 5
    assert after[("lorafleet_worker_step_seconds_sum", model)] > 0
    assert after[("lorafleet_worker_running_seqs", model)] == 0
    assert after[("lorafleet_worker_kv_blocks_used", model)] == 0
    assert after[("lorafleet_worker_adapters_resident", (("model", MODEL), ("tier", "gpu")))] == 1
    assert not any(name.startswith("lorafleet_worker_gpu_") for name, _ in after)
    for stage in JOB_STAGES:  # every job passed every stage once
        assert after[("lorafleet_worker_job_stage_seconds_count", (("model", MODEL), ("stage", stage)))] == 4
    # each job counted once, by arrival and by its adapter's tier when read: the adapter jobs routed to this
    # worker's own stream (the only worker: their home), the base-model jobs read from the shared stream
    started = {dict(labels)["arrival"] + "/" + dict(labels)["tier"]: value for (name, labels), value in after.items()
               if name == "lorafleet_worker_jobs_started_total"}  # fmt: skip
    assert sum(started.values()) == 4
    assert started["shared/none"] == 2
    assert sum(value for key, value in started.items() if key.startswith("routed/")) == 2


def test_a_finished_job_s_record_traces_its_way_through_the_worker_in_order(fleet: Fleet):
    fleet.start_gateway()
    fleet.start_worker("w1")
    [job_id] = fleet.submit(jobs_for(1, max_tokens=3))
    [record] = fleet.wait_finished([job_id], timeout_s=120)
    with fleet.redis() as client:
        stamps = [int(value) for value in client.hmget(keys.job(job_id), JobTrace.field_names())]
    assert all(stamps) and stamps == sorted(stamps), dict(zip(JobTrace.FIELDS, stamps, strict=True))
    # the gateway's whole-ms stamp of creation is the trace's, truncated (the two roundings may differ by one)
    assert abs(stamps[0] // 1000 - record.created_ms) <= 1
