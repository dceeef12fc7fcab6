"""A worker that stops reading stops advertising at once, and one whose loop fails exits non-zero within
its grace period, whatever else fails meanwhile."""

from __future__ import annotations

import time

import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from shared import keys
from shared.model_registry import ADAPTER_LIMITS
from tests.e2e.processes import wait_until
from tests.fleet import MODEL, Fleet, jobs_for

pytestmark = pytest.mark.slow

STOP_MARGIN_S = 10.0  # worker/service.py's


def test_a_draining_worker_withdraws_its_heartbeat_at_once_and_keeps_its_jobs(fleet: Fleet):
    fleet.start_gateway()
    draining = fleet.start_worker("draining", "--drain-grace", "60")
    job_ids = fleet.submit(jobs_for(8, max_tokens=400))  # they run for seconds after the SIGTERM
    wait_until(lambda: fleet.running_on("draining", job_ids) >= 2, timeout_s=30, what="the worker to run jobs")
    fleet.start_worker("steady")  # would take over any entry the draining worker stopped claiming

    draining.terminate()
    with fleet.redis() as client:

        def withdrawn() -> bool:
            limits = client.hget(keys.model(MODEL), ADAPTER_LIMITS + "draining")
            return (
                not client.exists(keys.worker("draining"))
                and not client.sismember(keys.WORKERS, "draining")
                and (limits is None)
            )

        wait_until(withdrawn, timeout_s=1.5, what="the heartbeat to be withdrawn")  # it would expire after 3 s
        running = fleet.running_on("draining", job_ids)
        assert draining.poll() is None and running, "the withdrawal must come while the worker still drains"
        time.sleep(0.9)  # three heartbeat intervals: a beat must not bring it back
        assert not client.exists(keys.worker("draining"))
    assert draining.wait(60) == 0
    records = fleet.wait_finished(job_ids, timeout_s=60)
    fleet.assert_nothing_lost(job_ids, records)
    # a draining worker's running entries stay claimed; a take-over of a live worker's entry comes only
    # when the loaded machine stalls past the fleet's claim idle time (tests/fleet.py), and is not the drain's
    taken_over = fleet.redeliveries("draining", "steady")
    deliveries = {r.job_id: r.attempts - taken_over[r.job_id] for r in records}
    assert set(deliveries.values()) == {1}, f"deliveries beyond the take-overs: {deliveries}"


def test_a_worker_whose_loops_fail_exits_nonzero_within_its_grace_period(fleet: Fleet):
    fleet.start_gateway()
    # room for 8 jobs (twice --max-num-seqs): of 16 routed to it (each through an adapter; it is their only
    # worker), 8 or more wait unread on its stream, which its stop hands over to the shared stream: a write
    # the full Redis refuses
    worker = fleet.start_worker("doomed", "--drain-grace", "1", "--max-num-seqs", "4")
    job_ids = fleet.submit([job | {"adapter": DEMO_ADAPTERS[0].name} for job in jobs_for(16, max_tokens=200)])
    wait_until(lambda: fleet.running_on("doomed", job_ids) >= 4, timeout_s=30, what="the worker to run jobs")

    with fleet.redis() as client:
        routed = keys.worker_queue(MODEL, "doomed")
        assert client.xlen(routed) > client.xpending(routed, keys.WORKER_GROUP)["pending"]
        # Redis now refuses every write that could grow its memory: the heartbeat's, the results', the hand-back's
        client.config_set("maxmemory", 1)
        try:
            started = time.monotonic()
            exit_code = worker.wait(1 + STOP_MARGIN_S + 5)
            took_s = time.monotonic() - started
            assert not client.sismember(keys.WORKERS, "doomed")  # deletions pass an out-of-memory Redis
        finally:
            client.config_set("maxmemory", 0)
    assert exit_code == 1
    assert took_s < 1 + STOP_MARGIN_S
    assert "worker_loop_failed" in fleet.log_of("doomed").read_text()
