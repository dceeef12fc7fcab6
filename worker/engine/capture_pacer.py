"""Spacing the graph captures of a model prepared beside one that serves (torch-free).

Capturing a runner's graphs (cuda_graphs.py, piecewise_graphs.py) is, for an 8B model, ~1,700 piece
captures and ~50 eager warm-up passes of up to 2,048 tokens: Python under the GIL and launches on
the GPU, both shared with the serving model's engine thread and its steps. Run flat out beside a
serving model, it held that model's decode at 0.34× of its throughput for the 9.2 s it took
(docs/benchmarks.md, issue #27).

Paced, the capturing thread works at most `busy_fraction` of the wall time: after each unit of
work (one graph captured, or one bucket's warm-up) it sleeps (1 - f) / f times as long as the unit
took, handing the GIL and the GPU back to the serving model. If the serving model runs at a
fraction s of its throughput while a unit runs (0.34 measured), it keeps 1 - f·(1 - s) overall:
0.84 at f = 0.25, the issue's ≤ 20 % cost; the capture takes 1/f times as long (it happens before
the hand-over, while the serving model goes on). With nothing serving beside it (a worker's first
model) there is nobody to yield to and the capture is not paced, and while the models beside it
have no request (`serving()` false) no rest is taken either. The rests fall inside the capture
session, so the process's cyclic garbage collector stays off for the whole, longer capture
(cuda_graphs.capture_session says why); reference counting frees everything else meanwhile.

The pacer also keeps the preparation's timeline (`timeline`): each unit of work with its kind, each
rest, and the stretches the runner marks between them (`mark`: its KV carve, its graphs' setup),
as plain intervals of the clock, so that a bench can say what the serving model ran at during each
(bench/overlap_timeline.py). A few thousand small records per preparation.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

BUSY_FRACTION = 0.25
REST = "rest"  # the kind of the timeline's rests


@dataclass(frozen=True, slots=True)
class Interval:
    """A stretch of a preparation's wall time, in the pacer's clock's seconds: a unit of work of
    `kind` (what the runner said it was), or a rest (kind REST)."""

    start: float
    end: float
    kind: str


class CapturePacer:
    def __init__(
        self,
        serving: Callable[[], bool],
        busy_fraction: float = BUSY_FRACTION,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not 0.0 < busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction must be in (0, 1], got {busy_fraction}")
        self.busy_fraction = busy_fraction
        self._serving = serving  # whether a model beside the capture has requests now (any thread may ask)
        self._clock = clock
        self._sleep = sleep
        self._resumed: float | None = None  # when the unit of work now running began
        self.slept_s = 0.0  # in total, for the runner's log line
        self.timeline: list[Interval] = []  # closed stretches, in order
        self._open: tuple[float, str] | None = None  # the stretch being recorded: its start and kind

    def pause(self, kind: str = "unit") -> None:
        """Call before each unit of work (of `kind`, for the timeline): while a model beside it
        serves, sleeps long enough that the work since the last call took at most `busy_fraction`
        of the time (the first call only starts the clock)."""
        now = self._clock()
        self._close(now)
        if self._resumed is not None and self._serving():
            rest = (now - self._resumed) * (1.0 - self.busy_fraction) / self.busy_fraction
            if rest > 0.0:
                self._sleep(rest)
                self.slept_s += rest
                rested, now = now, self._clock()
                self.timeline.append(Interval(rested, now, REST))
        self._resumed = now
        self._open = (now, kind)

    def mark(self, kind: str) -> None:
        """From now on the work is of `kind`, for the timeline only: no rest here. Before the first
        pause such work is not paced at all; after it, it counts towards the next pause's rest."""
        now = self._clock()
        self._close(now)
        self._open = (now, kind)

    def finish(self) -> None:
        """The preparation's work is done: closes the timeline's last stretch (no rest follows it)."""
        self._close(self._clock())
        self._open = None

    def seconds_by_kind(self) -> dict[str, float]:
        """Seconds of the closed timeline per kind (REST included), in order of first appearance."""
        seconds: dict[str, float] = defaultdict(float)
        for interval in self.timeline:
            seconds[interval.kind] += interval.end - interval.start
        return dict(seconds)

    def _close(self, now: float) -> None:
        if self._open is not None:
            start, kind = self._open
            self.timeline.append(Interval(start, now, kind))
            self._open = None
