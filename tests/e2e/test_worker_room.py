"""A worker holds no more jobs than its room (twice --max-num-seqs), however many streams they wait on:
base-model jobs on the model's shared stream and adapter jobs on its own routed stream are read
together, the oldest first, up to the room (worker/routed_streams.py, read_oldest). The rest wait
where any worker of the model can take them."""

from __future__ import annotations

import time

import pytest

from tests.e2e.processes import wait_until
from tests.fleet import Fleet, jobs_for

pytestmark = pytest.mark.slow


def test_a_worker_reading_two_streams_holds_no_more_jobs_than_its_room(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("w1", "--max-num-seqs", "4")  # room for 8
    job_ids = fleet.submit(jobs_for(16, max_tokens=300))  # 8 through an adapter (routed), 8 base (shared)

    wait_until(lambda: fleet.running_on("w1", job_ids) >= 8, timeout_s=30, what="the worker to fill its room")
    held = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        held.append(fleet.running_on("w1", job_ids))
        time.sleep(0.05)
    assert max(held) == 8, held
