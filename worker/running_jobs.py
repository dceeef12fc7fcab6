"""The jobs this worker has started and not yet let go (stored, canceled or handed back): what the
intake has room for, what the heartbeat keeps claimed, what a drain or a switch hands back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.schema import Priority


@dataclass(frozen=True, slots=True)
class JobTimes:
    """When a job reached this worker's I/O loop, unix seconds: made (the gateway's clock), read, started."""

    created: float
    read: float
    started: float


@dataclass(slots=True)
class RunningJob:
    model: str
    priority: Priority
    stream: str  # the stream its entry was read from: its class's shared stream or (interactive) a worker's
    entry_id: bytes
    request_id: str
    fields: dict[bytes, bytes]  # the entry as read, to queue it again if this worker lets it go
    started: float = field(default_factory=time.monotonic)  # when this worker started it
    times: JobTimes | None = None  # its trace so far (None: not started through the intake)


class RunningJobs:
    """At most `capacity` jobs, of which at most `batch_capacity` batch jobs: the rest of the room is
    always there for interactive jobs, so they reach the engine (and preempt batch work) at once."""

    def __init__(self, capacity: int, batch_capacity: int) -> None:
        self.capacity = capacity
        self.batch_capacity = batch_capacity
        self.jobs: dict[str, RunningJob] = {}
        self.room = asyncio.Event()  # set whenever a job leaves: the intake may read again

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.jobs

    def get(self, job_id: str) -> RunningJob | None:
        return self.jobs.get(job_id)

    @property
    def room_left(self) -> int:
        return self.capacity - len(self.jobs)

    @property
    def batch_room_left(self) -> int:
        batch = sum(1 for job in self.jobs.values() if job.priority is Priority.BATCH)
        return min(self.room_left, self.batch_capacity - batch)

    def add(self, job_id: str, job: RunningJob) -> None:
        self.jobs[job_id] = job

    def release(self, job_id: str) -> None:
        """The job ended here (stored or canceled): its room goes to the intake at once."""
        self.pop(job_id)
        self.room.set()

    def pop(self, job_id: str) -> RunningJob | None:
        """The job is no longer this worker's (handed back: a drain or a switch, when nothing new is read)."""
        return self.jobs.pop(job_id, None)

    def of_model(self, model: str) -> list[tuple[str, RunningJob]]:
        return [(job_id, job) for job_id, job in self.jobs.items() if job.model == model]

    def load_of(self, model: str) -> tuple[int, float]:
        """`model`'s running jobs here, and their summed seconds since they started."""
        now = time.monotonic()
        started = [job.started for job in self.jobs.values() if job.model == model]
        return len(started), sum(now - t for t in started)

    def entries_by_stream(self) -> dict[str, list[bytes]]:
        """Running entry ids by the stream that holds them."""
        by_stream: dict[str, list[bytes]] = {}
        for job in self.jobs.values():
            by_stream.setdefault(job.stream, []).append(job.entry_id)
        return by_stream
