"""How long the worker's asyncio I/O loop waits for the interpreter while the engine thread runs its
host Python beside it, and what the engine's device loses to the I/O loop's Python (CPU).

    python -m bench.io_handoff [--seconds 4] [--intervals 0.005 0.001 0.0005] [--io-ms 0.7 0.2] [--repeats 2]

The worker's two threads share one interpreter (worker/engine_thread.py, worker/results.py). A
thread that wants the GIL while the other runs Python waits until the holder drops it of its own
accord (a torch call, a socket read, a device wait) or, at the latest, for the switch interval
(`sys.getswitchinterval()`, 5 ms by default), after which the holder is asked to drop it.

This runs the two with the device taken out:
- engine: the engine's pipelined step (worker/engine/engine.py): LAUNCH_PY_S of Python (schedule,
  step inputs) and LAUNCH_CALLS torch calls launch step N on a modelled device that runs each step
  DEVICE_STEP_S after the one before it ends (idle while the host launches late); a GIL-free wait for
  step N-1's end; READ_PY_S of Python reading its tokens; then its output handed to the I/O loop
  with `call_soon_threadsafe`, as the worker does;
- I/O loop: per step output, `--io-ms` of Python (publishing the step's tokens), then a reply
  arriving from another process every ~REPLY_EVERY_S (Redis's replies, XREADGROUP's wake-ups).
Per switch interval and I/O load it prints the hand-over's wait (the output handed over → the loop
runs it: "last token → I/O loop took the result" in bench.e2e), a reply's wait (sent → the loop
reads it), and the device's idle time per step (the host launching late), beside the engine alone.
Python "ms" are calibrated on this machine alone, so the Python per step is the same in every row.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import torch

LAUNCH_PY_S = 0.001  # the engine's Python before step N's first torch call (scheduler, StepInputs)
LAUNCH_CALLS = 10  # torch calls launching a graph-replayed decode step (input copies, replay, sampling)
READ_PY_S = 0.0007  # Python reading a step's tokens (detokenizing, deltas) for ~32 sequences
DEVICE_STEP_S = 0.008  # an 8B decode step at batch ~32 on an H100 (bench.e2e, 32.5 req/s)
REPLY_EVERY_S = 0.0025  # mean gap between Redis replies reaching the loop


def _python_rate() -> float:
    """Iterations of `_spin` per second on this machine, with nothing beside it."""
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        _spin(1000)
        done += 1000
    return done / (time.perf_counter() - start)


def _spin(iterations: int) -> None:
    """Python that never drops the GIL by itself."""
    total = 0
    for i in range(iterations):
        total += i * i


class Engine:
    """The engine thread's stand-in; `on_output(handed_at)` is called once per step, as EngineThread's."""

    def __init__(self, rate: float, on_output: callable) -> None:
        self._launch, self._read = int(LAUNCH_PY_S * rate), int(READ_PY_S * rate)
        self._on_output = on_output
        self._x = torch.zeros(1)
        self.stop = threading.Event()
        self.idle_s: list[float] = []

    def run(self) -> None:
        device_free = time.perf_counter()  # when the device ends the last step launched
        while not self.stop.is_set():
            _spin(self._launch)
            x = self._x
            for i in range(LAUNCH_CALLS):
                x = torch.add(x, i)  # drops and retakes the GIL, as every torch call does
            launched = time.perf_counter()
            previous_end = device_free
            self.idle_s.append(max(0.0, launched - previous_end))
            device_free = max(launched, previous_end) + DEVICE_STEP_S
            time.sleep(max(0.0, previous_end - time.perf_counter()))  # step N-1's tokens: the GIL released
            _spin(self._read)
            self._on_output(time.perf_counter())


# Another process (no torch to import): a datagram stamped with its send time every ~REPLY_EVERY_S.
_SENDER = """
import random, socket, struct, sys, time
host, port, seconds, every = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(random.expovariate(1 / every))
        sock.sendto(struct.pack("d", time.time()), (host, port))
"""


async def _serve(rate: float, io_s: float, seconds: float) -> tuple[list[float], list[float], list[float]]:
    """(hand-over waits, reply waits, device idle per step), seconds."""
    loop = asyncio.get_running_loop()
    handovers: list[float] = []
    replies: list[float] = []
    io_iterations = int(io_s * rate)

    def took_output(handed_at: float) -> None:
        handovers.append(time.perf_counter() - handed_at)
        _spin(io_iterations)

    def read_reply() -> None:
        (sent,) = struct.unpack("d", sock.recv(8))
        replies.append(time.time() - sent)

    engine = Engine(rate, lambda handed_at: loop.call_soon_threadsafe(took_output, handed_at))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    loop.add_reader(sock, read_reply)
    host, port = sock.getsockname()
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, host, str(port), str(seconds), str(REPLY_EVERY_S)])
    thread = threading.Thread(target=engine.run, name="engine")
    thread.start()
    await asyncio.sleep(seconds)
    engine.stop.set()
    await asyncio.to_thread(thread.join)
    loop.remove_reader(sock)
    sock.close()
    await asyncio.to_thread(sender.wait)
    return handovers, replies, engine.idle_s[1:]


def _engine_alone(rate: float, seconds: float) -> list[float]:
    engine = Engine(rate, lambda handed_at: None)
    thread = threading.Thread(target=engine.run, name="engine")
    thread.start()
    time.sleep(seconds)
    engine.stop.set()
    thread.join()
    return engine.idle_s[1:]


def _ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.001, 0.0005])
    parser.add_argument("--io-ms", type=float, nargs="+", default=[0.7, 0.2], help="the I/O loop's Python per step")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rate = _python_rate()
    print(
        f"engine: {LAUNCH_PY_S * 1e3:.1f} ms Python + {LAUNCH_CALLS} torch calls to launch, "
        f"a {DEVICE_STEP_S * 1e3:.0f} ms device step, {READ_PY_S * 1e3:.1f} ms Python to read; "
        f"replies every ~{REPLY_EVERY_S * 1e3:.1f} ms"
    )
    print(
        "| switch interval ms | I/O Python ms/step | repeat | hand-over wait p50 / p99 ms | reply wait p50 / p99 ms "
        "| device idle ms/step (engine alone) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for interval in args.intervals:
        sys.setswitchinterval(interval)
        for io_ms in args.io_ms:
            for repeat in range(args.repeats):
                alone = _engine_alone(rate, args.seconds / 2)
                handovers, replies, idle = asyncio.run(_serve(rate, io_ms / 1000, args.seconds))
                print(
                    f"| {interval * 1e3:g} | {io_ms:g} | {repeat} "
                    f"| {_ms(handovers, 50):.2f} / {_ms(handovers, 99):.2f} "
                    f"| {_ms(replies, 50):.2f} / {_ms(replies, 99):.2f} "
                    f"| {1000 * statistics.fmean(idle):.3f} ({1000 * statistics.fmean(alone):.3f}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
