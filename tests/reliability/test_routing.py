"""Routing through the running stack: interactive jobs for an adapter run on one worker of two (its batch
jobs on the shared batch stream), and jobs routed to a worker that stopped reading are taken by the other
within the steal bound, each stored once."""

from __future__ import annotations

import json
import signal
import time

import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from shared import keys
from tests.fleet import MODEL, Fleet

pytestmark = pytest.mark.slow

STEAL_AFTER_MS = 200


def adapter_jobs(count: int) -> list[dict]:
    job = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "adapter": DEMO_ADAPTERS[0].name}
    return [job] * count


def started_counts(fleet: Fleet, worker: str) -> dict[str, int]:
    with fleet.redis() as client:
        return json.loads(client.hget(keys.worker(worker), "started") or b"{}")


def test_an_adapters_interactive_jobs_are_routed_to_one_worker_and_its_batch_jobs_are_not(fleet: Fleet):
    fleet.start_gateway()
    fleet.start_worker("w1", "--steal-after-ms", "5000")
    fleet.start_worker("w2", "--steal-after-ms", "5000")

    job_ids = fleet.submit(adapter_jobs(6))
    batch_ids = fleet.submit([{**job, "priority": "batch"} for job in adapter_jobs(4)])
    records = fleet.wait_finished(job_ids, timeout_s=60)
    batch_records = fleet.wait_finished(batch_ids, timeout_s=60)

    fleet.assert_nothing_lost(job_ids + batch_ids, records + batch_records)
    assert len({r.worker for r in records}) == 1  # its home, then the worker holding it
    time.sleep(1)  # a heartbeat carries the counts
    serving = records[0].worker
    assert sum(n for key, n in started_counts(fleet, serving).items() if key.startswith("routed/")) == 6
    # batch jobs wait on the model's shared batch stream, read by whichever worker has batch room
    counts = [started_counts(fleet, worker) for worker in ("w1", "w2")]
    assert sum(n for c in counts for key, n in c.items() if key.startswith("shared/")) == 4


def test_jobs_routed_to_a_worker_that_stopped_reading_are_stolen_within_the_bound(fleet: Fleet):
    fleet.start_gateway()
    processes = {name: fleet.start_worker(name, "--steal-after-ms", str(STEAL_AFTER_MS)) for name in ("w1", "w2")}
    [warm] = fleet.wait_finished(fleet.submit(adapter_jobs(1)), timeout_s=60)
    frozen = processes[warm.worker]  # the worker the adapter's jobs are routed to
    thief = next(name for name in processes if name != warm.worker)

    frozen.send_signal(signal.SIGSTOP)
    try:
        submitted = time.monotonic()
        job_ids = fleet.submit(adapter_jobs(4))
        records = fleet.wait_finished(job_ids, timeout_s=30)
        waited = time.monotonic() - submitted
    finally:
        frozen.send_signal(signal.SIGCONT)

    fleet.assert_nothing_lost(job_ids, records)
    assert all(r.worker == thief for r in records)
    assert "job_stolen" in fleet.log_of(thief).read_text()
    assert waited < 5  # the bound, a read block, the run; far less than a crash's claim time
