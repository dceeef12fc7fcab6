"""Admission pacing for engines with graph-replayed decode steps (torch-free, on a fake clock)."""

from __future__ import annotations

from worker.engine.admission_pacer import MAX_HOLD_S, AdmissionPacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def after_an_admitting_step(seconds: float) -> tuple[Clock, AdmissionPacer]:
    """A pacer whose last step admitted and took `seconds`, on a clock standing at that step's end."""
    clock = Clock()
    pacer = AdmissionPacer(clock)
    assert pacer.may_admit(running=True)
    pacer.admitted()
    clock.now += seconds
    return clock, pacer


def test_an_idle_engine_and_the_first_arrivals_are_admitted_at_once() -> None:
    pacer = AdmissionPacer(Clock())
    assert pacer.may_admit(running=False)
    assert pacer.may_admit(running=True)  # nothing admitted yet


def test_after_an_admitting_step_new_arrivals_wait_as_long_again_in_decode_steps() -> None:
    clock, pacer = after_an_admitting_step(0.030)  # an eager step of 30 ms
    decode_steps = 0
    while not pacer.may_admit(running=True):  # 8 ms graph-replayed decode steps
        decode_steps += 1
        clock.now += 0.008
    assert decode_steps == 4  # 32 ms of decode steps after the 30 ms admitting one
    assert pacer.may_admit(running=True)  # still allowed until the next admission


def test_nothing_running_lifts_the_pause() -> None:
    _, pacer = after_an_admitting_step(0.030)
    assert not pacer.may_admit(running=True)
    assert pacer.may_admit(running=False)


def test_steps_that_admit_nothing_do_not_move_the_pace() -> None:
    clock, pacer = after_an_admitting_step(0.020)
    assert not pacer.may_admit(running=True)  # the admitting step took 20 ms: hold for 20 more
    clock.now += 0.021
    assert pacer.may_admit(running=True)  # allowed, but this step found nobody to admit
    clock.now += 0.100
    assert pacer.may_admit(running=True)  # so the next arrival is admitted at once


def test_a_slow_admitting_step_holds_arrivals_no_longer_than_the_cap() -> None:
    clock, pacer = after_an_admitting_step(2.0)  # a first use: Triton compiled this step's kernels
    assert not pacer.may_admit(running=True)
    clock.now += MAX_HOLD_S + 1e-9
    assert pacer.may_admit(running=True)
