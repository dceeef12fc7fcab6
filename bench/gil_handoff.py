"""Does the GIL slow a serving engine thread while a loader thread prepares a model beside it? (CPU)

    python -m bench.gil_handoff [--seconds 4] [--intervals 0.005 0.0005] [--repeats 2]

A serving engine thread spends most of a GPU step waiting on the device with the GIL released (the
copy of the previous step's tokens, a synchronisation) and every torch call releases and retakes
it too. When it wants the GIL back while another thread is running Python, CPython lets it wait
until that thread next drops the GIL of its own accord or, at the latest, for the switch interval
(`sys.getswitchinterval()`, 5 ms by default), after which the holder is asked to drop it.

This runs, on the CPU, the two threads of issue #27's overlap with the device taken out:
- serving: `step()` = STEP_CALLS tiny torch calls (each drops and retakes the GIL, as the engine's
  host side does) with a little Python between them, then a GIL-free wait of DEVICE_WAIT_S standing
  for the device's step (a 1B-shaped decode step at batch 32 on an H100 is ~1.6 ms);
- loader: units paced by the worker's CapturePacer (busy a quarter of the time), either
  "capture-like" (Python and tiny torch calls, the host side of recording a graph: no compute) or
  "pure Python" (a loop that never drops the GIL by itself: gc.collect, structlog, building the
  metadata of a capture);
and prints, per switch interval and unit, the serving thread's step rate and step times during
the units and the rests beside the serving thread alone (bench/overlap_timeline.py), and the
loader's own rate of work inside its units against the loader alone (a shorter switch interval
hands the GIL over more often, which may slow the preparation instead).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from bench.overlap_timeline import Step, format_table, split_by_kind, whole
from worker.engine.capture_pacer import CapturePacer

STEP_CALLS = 30  # torch calls on the host per decode step (inputs, graph replay, sampling, copies)
DEVICE_WAIT_S = 0.0015  # the GIL-free wait for the device per step
UNIT_S = 0.008  # one unit of the loader's work (a piece capture of an 8B model: ~15 s / 1,716 units)


class Serving:
    """The serving engine thread's stand-in: steps until told to stop, each recorded as a Step of one token."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.stop = threading.Event()
        self._x = torch.zeros(1)

    def step(self) -> None:
        start = time.perf_counter()
        x = self._x
        for i in range(STEP_CALLS):
            x = torch.add(x, i)  # drops and retakes the GIL, as every torch call does
        time.sleep(DEVICE_WAIT_S)  # the device's step: the GIL released
        self.steps.append(Step(start, time.perf_counter(), 1))

    def run(self) -> None:
        while not self.stop.is_set():
            self.step()


def capture_like_unit(seconds: float) -> int:
    """Python and tiny torch calls for `seconds`: the host side of recording a graph. Returns the
    iterations done."""
    end, done = time.perf_counter() + seconds, 0
    x = torch.zeros(1)
    while time.perf_counter() < end:
        meta = {f"k{i}": i * 2 for i in range(20)}  # a little Python between calls
        x = torch.mul(x, len(meta))
        done += 1
    return done


def pure_python_unit(seconds: float) -> int:
    """A loop that never drops the GIL by itself, for `seconds`. Returns the iterations done."""
    end, done = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        sum(i * i for i in range(200))
        done += 1
    return done


UNITS = {"capture-like": capture_like_unit, "pure Python": pure_python_unit}


def measure(unit_name: str, interval: float, seconds: float) -> str:
    """The serving thread alone for `seconds`, the loader alone for a quarter of that, then both for
    `seconds`: the table and the loader's rate beside the serving thread over its rate alone."""
    sys.setswitchinterval(interval)
    unit = UNITS[unit_name]
    loader_alone = sum(unit(UNIT_S) for _ in range(int(seconds / 4 / UNIT_S))) / (int(seconds / 4 / UNIT_S) * UNIT_S)
    alone = Serving()
    thread = threading.Thread(target=alone.run)
    thread.start()
    time.sleep(seconds)
    alone.stop.set()
    thread.join()
    serving = Serving()
    pacer = CapturePacer(serving=lambda: True)
    thread = threading.Thread(target=serving.run)
    thread.start()
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        pacer.pause(unit_name)
        done += unit(UNIT_S)
    pacer.finish()
    serving.stop.set()
    thread.join()
    timeline = pacer.timeline
    rows = split_by_kind(serving.steps, timeline, timeline[0].start, timeline[-1].end)
    loader_beside = done / pacer.seconds_by_kind()[unit_name]
    table = format_table(rows, whole(alone.steps, "alone"))
    return f"{table}\nloader's work per second of its units: × {loader_beside / loader_alone:.2f} of the loader alone"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.0005])
    parser.add_argument("--units", nargs="+", default=list(UNITS), choices=list(UNITS))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the measured effect is the GIL's, not intra-op threads competing for cores
    default = sys.getswitchinterval()
    try:
        for repeat in range(args.repeats):
            for unit_name in args.units:
                for interval in args.intervals:
                    print(f"\nrepeat {repeat}, loader units {unit_name}, switch interval {interval * 1e3:g} ms")
                    print(measure(unit_name, interval, args.seconds), flush=True)
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
