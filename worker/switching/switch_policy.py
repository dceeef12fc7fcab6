"""When a worker with more models than resident slots switches, and to which model. Torch-free.

Cost model (times in seconds, loads in jobs):

- A switch to model m costs a pause of C_m: its checkpoint's bytes over the measured bandwidth of
  the tier it comes from (pinned host → device for a warm model, disk for a cold one), plus the
  hand-over. While the outgoing model drains, its running jobs keep going; the queued ones wait.
- The *pressure* of a queue is the job-seconds its waiting jobs have already waited,
  P = waiting × oldest_wait. It grows with time as long as jobs wait, so no queue starves.
- Switching in m and out v is worth it when m's pressure outweighs what the switch costs v:
  P_m > C_m × load_v + P_v + R_v, where load_v is v's running plus waiting jobs (each is delayed by
  about one pause, now or when v comes back), P_v is the pressure v's own queue keeps building
  while it is away, and R_v the job-seconds v's running jobs have run: the work thrown away if they
  outlast the switch grace and are handed back. R_v grows as they run, so long jobs are not
  preempted by a trickle, while a queue that keeps growing still gets its turn once they turn over.
  An idle resident model (nothing running or waiting) is switched out for the first waiting job.
- Hysteresis: a model stays resident at least MIN_RESIDENCY_FACTOR × C_m after it came in, so two
  busy models alternate in turns of at least twice the switch time, never thrash.
- With a free resident slot, the model with the most pressure is loaded without evicting anyone.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_RESIDENCY_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class QueueState:
    """A model's stream as seen without consuming it: entries no worker has read (or whose reader
    died), and how long the oldest of them has waited."""

    waiting: int
    oldest_wait_s: float

    @property
    def pressure(self) -> float:
        """Job-seconds already waited (an underestimate: the oldest wait times the count)."""
        return self.waiting * self.oldest_wait_s


@dataclass(frozen=True, slots=True)
class ResidentModel:
    model: str
    queue: QueueState
    in_flight: int  # jobs this worker runs for it
    running_s: float  # their summed time since they started here
    resident_for_s: float

    @property
    def load(self) -> int:
        return self.in_flight + self.queue.waiting


@dataclass(frozen=True, slots=True)
class CandidateModel:
    model: str
    queue: QueueState
    switch_cost_s: float  # C: bytes over the bandwidth of its tier, plus the hand-over


@dataclass(frozen=True, slots=True)
class SwitchDecision:
    incoming: str
    outgoing: str | None  # None: a resident slot is free
    reason: str


def choose_switch(
    residents: list[ResidentModel], candidates: list[CandidateModel], *, free_slots: int
) -> SwitchDecision | None:
    """The switch to make now, or None to keep the resident set."""
    waiting = [c for c in candidates if c.queue.waiting > 0]
    if not waiting:
        return None
    best = max(waiting, key=lambda c: (c.queue.pressure, c.queue.oldest_wait_s))
    if free_slots > 0:
        return SwitchDecision(best.model, None, "a resident slot is free")
    settled = [r for r in residents if r.resident_for_s >= MIN_RESIDENCY_FACTOR * best.switch_cost_s]
    if not settled:
        return None
    victim = min(settled, key=lambda r: (r.load, r.queue.pressure + r.running_s))
    cost = best.switch_cost_s * victim.load + victim.queue.pressure + victim.running_s
    if best.queue.pressure <= cost and victim.load > 0:
        return None
    return SwitchDecision(
        best.model,
        victim.model,
        f"pressure {best.queue.pressure:.2f} job-s over cost {cost:.2f} job-s (load {victim.load})",
    )
