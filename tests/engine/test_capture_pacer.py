"""The capture pacer keeps a capture beside a serving model to its share of the wall time."""

from __future__ import annotations

import itertools

import pytest

from worker.engine.capture_pacer import REST, CapturePacer, Interval


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def pacer_on(clock: Clock, busy_fraction: float, serving=lambda: True) -> CapturePacer:
    return CapturePacer(serving, busy_fraction, clock=clock, sleep=clock.sleep)


def test_each_unit_is_followed_by_a_rest_that_holds_the_work_to_its_fraction():
    clock = Clock()
    pacer = pacer_on(clock, 0.25)
    pacer.pause()  # before the first unit: only starts the clock
    for unit_s in (0.010, 0.002, 0.050):
        clock.now += unit_s
        pacer.pause()
    assert clock.slept == pytest.approx([0.030, 0.006, 0.150])
    assert 0.062 / clock.now == pytest.approx(0.25)
    assert pacer.slept_s == pytest.approx(0.186)


def test_the_first_pause_does_not_sleep():
    clock = Clock()
    clock.now = 100.0
    pacer_on(clock, 0.25).pause()
    assert clock.slept == []


def test_the_rest_is_measured_from_the_end_of_the_last_rest_not_its_start():
    clock = Clock()
    pacer = pacer_on(clock, 0.5)
    pacer.pause()
    clock.now += 0.1
    pacer.pause()  # sleeps 0.1
    clock.now += 0.1
    pacer.pause()  # the second unit alone: 0.1 more, not 0.2
    assert clock.slept == pytest.approx([0.1, 0.1])


def test_a_fraction_of_one_never_sleeps():
    clock = Clock()
    pacer = pacer_on(clock, 1.0)
    for _ in range(3):
        clock.now += 0.5
        pacer.pause()
    assert clock.slept == []


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: float):
    with pytest.raises(ValueError, match="busy_fraction"):
        CapturePacer(lambda: True, fraction)


def test_no_rest_follows_a_unit_while_nothing_beside_the_capture_has_requests():
    clock = Clock()
    requests = [True]
    pacer = pacer_on(clock, 0.25, serving=lambda: requests[0])
    pacer.pause()
    clock.now += 0.010
    requests[0] = False  # the serving model ran out of work
    pacer.pause()
    clock.now += 0.010
    requests[0] = True
    pacer.pause()  # paces the unit since the last pause, not the unrested one before it
    assert clock.slept == pytest.approx([0.030])


def test_the_timeline_holds_each_unit_with_its_kind_and_each_rest():
    clock = Clock()
    pacer = pacer_on(clock, 0.5)
    pacer.pause("warm-up")
    clock.now += 0.1
    pacer.pause("capture")  # rests 0.1
    clock.now += 0.2
    pacer.finish()
    assert pacer.timeline == [
        Interval(0.0, 0.1, "warm-up"),
        Interval(0.1, pytest.approx(0.2), REST),
        Interval(pytest.approx(0.2), pytest.approx(0.4), "capture"),
    ]


def test_marked_work_before_the_first_pause_is_recorded_and_not_rested_for():
    clock = Clock()
    pacer = pacer_on(clock, 0.25)
    pacer.mark("kv carve")
    clock.now += 0.5
    pacer.pause("warm-up")
    assert clock.slept == []
    assert pacer.timeline == [Interval(0.0, 0.5, "kv carve")]


def test_marked_work_after_a_pause_counts_towards_the_next_rest():
    clock = Clock()
    pacer = pacer_on(clock, 0.5)
    pacer.pause("capture")
    clock.now += 0.1
    pacer.mark("setup")  # a stretch of its own on the timeline, no rest of its own
    clock.now += 0.3
    pacer.pause("capture")
    assert clock.slept == pytest.approx([0.4])
    assert [i.kind for i in pacer.timeline] == ["capture", "setup", REST]
    assert pacer.seconds_by_kind() == {
        "capture": pytest.approx(0.1),
        "setup": pytest.approx(0.3),
        REST: pytest.approx(0.4),
    }


def test_no_rest_is_recorded_while_nothing_beside_the_capture_has_requests():
    clock = Clock()
    pacer = pacer_on(clock, 0.25, serving=lambda: False)
    pacer.pause("capture")
    clock.now += 0.010
    pacer.pause("capture")
    clock.now += 0.010
    pacer.finish()
    assert [i.kind for i in pacer.timeline] == ["capture", "capture"]
    assert pacer.timeline[-1].end == pytest.approx(0.020)


def test_the_timeline_leaves_no_gap_between_stretches():
    clock = Clock()
    pacer = pacer_on(clock, 0.25, serving=lambda: clock.now < 1.0)
    pacer.mark("setup")
    for _ in range(4):
        clock.now += 0.3
        pacer.pause("capture")
    pacer.finish()
    timeline = pacer.timeline
    assert all(a.end == b.start for a, b in itertools.pairwise(timeline))
    assert [i.kind for i in timeline] == ["setup", "capture", REST, "capture", "capture", "capture"]
