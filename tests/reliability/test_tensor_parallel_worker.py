"""A tensor-parallel worker (`lorafleet worker --tensor-parallel 2`, two CPU processes over gloo) through
the whole stack: it serves base and adapter jobs with the tokens a one-process worker gives them,
stops cleanly with its follower, and a follower that dies takes it down (exit non-zero, in bounded
time) while another worker takes over its jobs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.processes import wait_until
from tests.fleet import Fleet, jobs_for

pytestmark = pytest.mark.slow

FP32 = ("--dtype", "float32")  # one-process and two-rank workers may differ only in summation order
EXIT_BOUND_S = 15.0  # worker/tensor_parallel.py: exits within 10 s of a rank's death


def follower_of(worker_pid: int) -> int:
    """The pid of the worker's rank-1 process (spawned by multiprocessing, beside its resource tracker)."""
    tasks = Path(f"/proc/{worker_pid}/task")
    children = {int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()}
    followers = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(followers) == 1, followers
    return followers[0]


def exited(pid: int) -> bool:
    """Whether `pid` is gone (or a zombie: its parent, the worker, has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def outputs(fleet: Fleet, jobs: list[dict]) -> list[tuple[int, ...]]:
    records = fleet.wait_finished(fleet.submit(jobs), timeout_s=120)
    assert all(r.status.value == "succeeded" for r in records), records[:2]
    return [r.output.token_ids for r in records]


def assert_two_ranks_serve_one_process_tokens(fleet: Fleet, *device: str) -> None:
    fleet.start_gateway()
    jobs = jobs_for(8, max_tokens=12)  # half through the tenant's adapter
    parallel = fleet.start_worker("tp", "--tensor-parallel", "2", *FP32, *device)
    follower = follower_of(parallel.pid)
    from_two_ranks = outputs(fleet, jobs)

    parallel.send_signal(signal.SIGTERM)
    assert parallel.wait(30) == 0
    wait_until(lambda: exited(follower), timeout_s=10, what="the follower to end with rank 0")

    fleet.start_worker("single", *FP32, *device)
    assert outputs(fleet, jobs) == from_two_ranks


def test_a_tensor_parallel_worker_serves_adapter_jobs_with_one_process_tokens(fleet: Fleet):
    assert_two_ranks_serve_one_process_tokens(fleet)


@pytest.mark.gpu
@pytest.mark.timeout(300)  # three GPU processes start, each capturing its decode graphs
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_worker_over_two_gpus_serves_adapter_jobs_with_one_gpus_tokens(fleet: Fleet):
    assert_two_ranks_serve_one_process_tokens(fleet, "--device", "cuda", "--kernel-tune-budget-s", "0")


def test_a_dead_rank_takes_its_worker_down_and_another_worker_takes_its_jobs(fleet: Fleet):
    fleet.start_gateway()
    parallel = fleet.start_worker("tp", "--tensor-parallel", "2", *FP32)
    fleet.start_worker("survivor", *FP32)
    job_ids = fleet.submit(jobs_for(24, max_tokens=96))
    wait_until(lambda: fleet.running_on("tp", job_ids) >= 2, timeout_s=60, what="the two-rank worker to run jobs")

    os.kill(follower_of(parallel.pid), signal.SIGKILL)
    killed = time.monotonic()
    exit_code = parallel.wait(EXIT_BOUND_S + 5)

    assert exit_code != 0
    assert time.monotonic() - killed < EXIT_BOUND_S
    assert "tensor_parallel_rank_died" in fleet.log_of("tp").read_text()
    records = fleet.wait_finished(job_ids, timeout_s=120)
    fleet.assert_nothing_lost(job_ids, records)
    assert any(r.attempts == 2 and r.worker == "survivor" for r in records), "no job of the dead worker was re-run"
