"""bench/fleet_model.py keeps the rules of the fleet it models: every job runs, a worker holds no more
jobs than its room and runs no more than its slots, reads its work oldest first, steals only what waited
past the bound, and keeps its GPU tier within the pool. The bench's figures (bench/fleet_sim.py --model)
stand on these."""

from __future__ import annotations

import random

import pytest

from bench.fleet_model import FleetModel, FleetShape, Job

SHAPE = FleetShape(workers=3, pool=4, max_num_seqs=2, service_s=0.1)


def zipf_jobs(count: int, adapters: int, seed: int, spacing_s: float) -> list[Job]:
    rng = random.Random(seed)
    weights = [1 / rank for rank in range(1, adapters + 1)]
    names = rng.choices([f"a{index}" for index in range(adapters)], weights=weights, k=count)
    return [Job(name, index * spacing_s) for index, name in enumerate(names)]


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of the [start, end) intervals that overlap at any instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    held = most = 0
    for _, change in events:  # at equal times an end (-1) sorts before a start: [start, end) intervals
        held += change
        most = max(most, held)
    return most


@pytest.mark.parametrize("routed", [False, True], ids=["shared", "routed"])
def test_every_job_runs_and_no_worker_holds_more_than_its_room_or_runs_more_than_its_slots(routed: bool):
    jobs = zipf_jobs(300, adapters=20, seed=1, spacing_s=0.002)  # a burst: ~5 times what the fleet runs
    fleet = FleetModel(SHAPE, routed)

    fleet.run(jobs)

    assert all(job.worker and job.read_at >= job.at and job.started_at >= job.read_at for job in jobs)
    for worker in fleet.workers:
        mine = [job for job in jobs if job.worker == worker.name]
        held = most_at_once([(job.read_at, job.started_at + SHAPE.service_s) for job in mine])
        running = most_at_once([(job.started_at, job.started_at + SHAPE.service_s) for job in mine])
        assert held == worker.capacity == 2 * SHAPE.max_num_seqs  # the burst fills the room, never more
        assert running == SHAPE.max_num_seqs
        assert len(worker.gpu) <= SHAPE.pool


def test_a_shared_fleet_reads_its_stream_oldest_first():
    jobs = zipf_jobs(200, adapters=20, seed=2, spacing_s=0.002)
    FleetModel(SHAPE, routed=False).run(jobs)

    by_read = sorted(jobs, key=lambda job: (job.read_at, job.at))
    assert [job.at for job in by_read] == sorted(job.at for job in jobs)


def test_a_routed_fleet_sends_an_adapter_home_and_steals_only_what_waited_past_the_bound():
    jobs = [Job("hot", index * 0.001) for index in range(60)]  # one adapter: one home, far over its room
    fleet = FleetModel(SHAPE, routed=True)

    fleet.run(jobs)

    homes = {job.home for job in jobs}
    assert len(homes) == 1
    stolen = [job for job in jobs if job.stolen]
    assert stolen, "idle workers left a busy home's backlog waiting"
    assert all(job.worker != job.home for job in stolen)
    assert all(job.read_at - job.at >= SHAPE.steal_after_ms / 1000 for job in stolen)
    assert all(job.worker == job.home for job in jobs if not job.stolen and job.placement.value == "home")


def test_a_workers_gpu_tier_serves_repeats_and_reads_a_new_adapter_from_disk_once():
    jobs = [Job(name, index * 0.5) for index, name in enumerate(["a", "a", "b", "a", "b"])]  # one at a time
    fleet = FleetModel(FleetShape(workers=1, pool=4, max_num_seqs=2, service_s=0.1), routed=False)

    fleet.run(jobs)

    assert [job.tier for job in jobs] == ["disk", "gpu", "disk", "gpu", "gpu"]
