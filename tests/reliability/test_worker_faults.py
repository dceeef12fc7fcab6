"""Workers that die or are stopped under load lose no job, and no job gets two results, with adapter
routing on (the gateway's default): the adapter's jobs are routed to the worker that dies or drains,
which ran the adapter first and holds it (gateway/routing.py), so its own routed stream is re-claimed
or handed over, beside the shared one."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from shared import keys
from tests.e2e.processes import wait_until
from tests.fleet import MODEL, Fleet, assert_equal_jobs_equal_outputs, jobs_for

pytestmark = pytest.mark.slow

DRAIN_GRACE_S = 0.5


def holding_the_adapter(fleet: Fleet, name: str, *flags: str) -> subprocess.Popen:
    """Start worker `name` alone and run one job of the demo adapter on it: the adapter's next jobs are
    routed to it (it holds the adapter on its device) while it has room."""
    worker = fleet.start_worker(name, *flags)
    [warm] = fleet.wait_finished(fleet.submit(jobs_for(2, max_tokens=1)[1:]), timeout_s=60)  # the adapter's job
    assert warm.worker == name
    return worker


def routed_stream_of(worker: str) -> str:
    return keys.worker_queue(MODEL, worker)


def test_killing_a_worker_mid_generation_loses_no_job(fleet: Fleet):
    fleet.start_gateway()
    doomed = holding_the_adapter(fleet, "doomed")
    fleet.start_worker("survivor")
    jobs = jobs_for(100, max_tokens=16)
    job_ids = fleet.submit(jobs)
    adapter_ids = [job_id for job, job_id in zip(jobs, job_ids, strict=True) if "adapter" in job]
    wait_until(
        lambda: fleet.running_on("doomed", adapter_ids) >= 2, timeout_s=30, what="the doomed worker to run routed jobs"
    )
    doomed.send_signal(signal.SIGSTOP)  # frozen: what it runs cannot change between the snapshot and the kill
    running_when_killed = {
        r.job_id for r in fleet.records(job_ids) if r.worker == "doomed" and not r.status.is_terminal
    }

    doomed.send_signal(signal.SIGKILL)

    records = fleet.wait_finished(job_ids, timeout_s=90)
    fleet.assert_nothing_lost(job_ids, records)
    assert_equal_jobs_equal_outputs(jobs, records)
    by_id = {r.job_id: r for r in records}
    for job_id in running_when_killed:  # each was run again by the survivor and stored once
        assert by_id[job_id].attempts == 2 and by_id[job_id].worker == "survivor", by_id[job_id]
    taken_over = fleet.redeliveries("doomed", "survivor")  # beyond the kill: a stall past the claim idle time
    assert all(r.attempts == 1 + taken_over[r.job_id] for r in records if r.job_id not in running_when_killed)
    # some of what the survivor took over had been routed to the doomed worker's own stream
    log = fleet.log_of("survivor").read_text().splitlines()
    reclaimed = [json.loads(line) for line in log if "job_reclaimed" in line]
    assert any(event["stream"] == routed_stream_of("doomed") for event in reclaimed), reclaimed


def test_a_sigtermed_worker_drains_within_its_grace_period_and_loses_no_job(fleet: Fleet):
    fleet.start_gateway()
    draining = holding_the_adapter(fleet, "draining", "--drain-grace", str(DRAIN_GRACE_S))
    fleet.start_worker("steady")
    jobs = jobs_for(40, max_tokens=96)
    job_ids = fleet.submit(jobs)
    adapter_ids = [job_id for job, job_id in zip(jobs, job_ids, strict=True) if "adapter" in job]
    wait_until(lambda: fleet.running_on("draining", adapter_ids) >= 2, timeout_s=30, what="the worker to run jobs")

    draining.send_signal(signal.SIGTERM)
    started = time.monotonic()
    exit_code = draining.wait(DRAIN_GRACE_S + 10)

    # grace, then the engine's last step and handing back; far less than the 1.5 s a crash would cost
    assert exit_code == 0
    assert time.monotonic() - started < DRAIN_GRACE_S + 5
    records = fleet.wait_finished(job_ids, timeout_s=90)
    fleet.assert_nothing_lost(job_ids, records)
    assert_equal_jobs_equal_outputs(jobs, records)
    # a graceful hand-back must not count as a delivery; a take-over of a live worker's entry does, and comes
    # whenever the loaded machine stalls past the fleet's claim idle time (tests/fleet.py)
    taken_over = fleet.redeliveries("draining", "steady")
    deliveries = {r.job_id: r.attempts - taken_over[r.job_id] for r in records}
    assert set(deliveries.values()) == {1}, f"deliveries beyond the take-overs: {deliveries}"
    # whether any job outlived the grace (and was handed back) depends on the machine's speed: the
    # hand-back itself is asserted in tests/e2e/test_model_switching.py, where it is certain
    with fleet.redis() as client:
        assert not client.sismember(keys.WORKERS, "draining")
        # its routed stream: handed over at the stop, deleted once empty (by it, or by the steady worker's adoption)
        wait_until(lambda: not client.exists(routed_stream_of("draining")), timeout_s=10, what="the stream to go")
