"""A Redis restart (SHUTDOWN, then a new server on the same port and AOF data dir) loses no job:
the gateway and the worker reconnect by themselves and every accepted job completes once, those
routed to the worker's own stream (adapter routing, the gateway's default) as those on the shared one."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from cli.redis_server import RedisServer
from shared import keys
from shared.schema import JobStatus
from tests.e2e.processes import wait_until
from tests.fleet import CLAIM_IDLE_MS, MODEL, assert_equal_jobs_equal_outputs, jobs_for, open_fleet

pytestmark = pytest.mark.slow

# down for longer than the claim idle time, so the worker's own claims look abandoned afterwards
DOWNTIME_S = CLAIM_IDLE_MS / 1000 + 0.5


def test_jobs_queued_and_running_across_a_redis_restart_all_complete(demo_assets, tmp_path: Path):
    server = RedisServer(tmp_path / "redis", append_only=True)
    with ExitStack() as stack:
        server.start()
        stack.callback(server.stop)
        fleet = open_fleet(server.url, demo_assets, tmp_path, stack)
        gateway = fleet.start_gateway()
        worker = fleet.start_worker("w1")
        jobs = jobs_for(60, max_tokens=16)  # more than the worker holds (16) and can finish before a restart
        job_ids = fleet.submit(jobs)
        adapter_ids = [job_id for job, job_id in zip(jobs, job_ids, strict=True) if "adapter" in job]
        wait_until(
            lambda: fleet.running_on("w1", job_ids) >= 2 and fleet.running_on("w1", adapter_ids) >= 1,
            timeout_s=30,
            what="running jobs, one of them routed",
        )
        before = [r.status for r in fleet.records(job_ids)]
        with fleet.redis() as client:  # adapter jobs are routed (the gateway's default) to w1's own stream
            assert client.xlen(keys.worker_queue(MODEL, "w1")) >= 1

        server.stop()  # SIGTERM: Redis writes its AOF and exits
        time.sleep(DOWNTIME_S)
        server.start()

        records = fleet.wait_finished(job_ids, timeout_s=90)
        fleet.assert_nothing_lost(job_ids, records)
        assert_equal_jobs_equal_outputs(jobs, records)
        assert JobStatus.QUEUED in before and JobStatus.RUNNING in before  # the restart hit both kinds
        after = fleet.submit(jobs_for(1, max_tokens=4))
        assert fleet.wait_finished(after, timeout_s=30)[0].status is JobStatus.SUCCEEDED
        assert gateway.poll() is None and worker.poll() is None
