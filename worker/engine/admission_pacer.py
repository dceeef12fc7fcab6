"""When an engine whose decode-only steps replay CUDA graphs admits new sequences (torch-free).

A step that admits new sequences prefills them, and a step with any prefill runs eagerly: host-bound
kernel launches, several times as long as a graph-replayed decode step of the same batch. Under a
steady stream of arrivals, admitting at every step makes nearly every step eager
(docs/benchmarks.md, "Whole stack under load").

The pacer spaces admitting steps: after one, new sequences wait until as much time again has gone
to steps that admit nothing, so at least about half of the time goes to graph-replayed decode steps,
and an arrival waits at most about one eager step (MAX_HOLD_S at most) longer for its first token.
It never holds back while nothing runs. Sequences already running, prefill chunks included, are never held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# The longest an arrival is held: an admitting step that compiled kernels (a first use) or waited on
# something else must not hold admissions for as long again (an 8B model's eager steps take tens of ms).
MAX_HOLD_S = 0.1


class AdmissionPacer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._step_started = 0.0
        self._admitted_at: float | None = None  # start of the last step that admitted
        self._admit_step_s = 0.0  # how long that step took: until the next step started
        self._timing_admit_step = False

    def may_admit(self, *, running: bool) -> bool:
        """Whether the step starting now may admit new sequences."""
        now = self._step_started = self._clock()
        if self._timing_admit_step:
            self._admit_step_s = now - self._admitted_at
            self._timing_admit_step = False
        if not running or self._admitted_at is None:
            return True
        return now - self._admitted_at >= self._admit_step_s + min(self._admit_step_s, MAX_HOLD_S)

    def admitted(self) -> None:
        """The step that last asked `may_admit` admitted new sequences."""
        self._admitted_at = self._step_started
        self._timing_admit_step = True
