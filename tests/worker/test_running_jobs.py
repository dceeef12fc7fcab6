"""The worker's running-job room: batch jobs take at most their share, so interactive jobs always find room."""

from __future__ import annotations

from shared import keys
from shared.schema import Priority
from worker.running_jobs import RunningJob, RunningJobs


def add(running: RunningJobs, job_id: str, priority: Priority, stream: str | None = None) -> None:
    running.add(job_id, RunningJob("m", priority, stream or keys.queue("m", priority), b"1-0", "", {}))


def test_batch_jobs_fill_only_their_share_and_interactive_jobs_the_rest() -> None:
    running = RunningJobs(capacity=4, batch_capacity=2)
    add(running, "b1", Priority.BATCH)
    add(running, "b2", Priority.BATCH)

    assert (running.room_left, running.batch_room_left) == (2, 0)
    add(running, "i1", Priority.INTERACTIVE)
    running.release("b1")
    assert (running.room_left, running.batch_room_left) == (2, 1)
    add(running, "i2", Priority.INTERACTIVE)
    add(running, "i3", Priority.INTERACTIVE)
    assert (running.room_left, running.batch_room_left) == (0, 0)  # the whole room is never over capacity


def test_entries_are_grouped_by_the_stream_that_holds_them() -> None:
    running = RunningJobs(capacity=4, batch_capacity=2)
    add(running, "b1", Priority.BATCH)
    add(running, "i1", Priority.INTERACTIVE)
    add(running, "i2", Priority.INTERACTIVE, keys.worker_queue("m", "w1"))

    assert running.entries_by_stream() == {
        keys.queue("m", Priority.BATCH): [b"1-0"],
        keys.queue("m"): [b"1-0"],
        keys.worker_queue("m", "w1"): [b"1-0"],
    }
