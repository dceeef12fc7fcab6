"""The device's clocks, power, temperature and clock slowdowns through a run, from the worker's NVML
gauges (worker/gpu_metrics.py) sampled once a second: in the stack from the worker's /metrics, in
the engine-alone replay from the same collector in this process. Whether a step ran slower because
the device did (a power cap or heat held its clocks down) or because the host fed it late.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.e2e.worker_metrics import Snapshot, gauge
from worker.gpu_metrics import SLOWDOWN_REASONS

Probe = dict[str, float]  # one once-a-second reading: name → value (nan where the worker exports no such series)


def device_probe(snapshot: Snapshot) -> Probe:
    """The device's gauges in one scrape: utilisation %, SM and memory clocks (MHz), power (W),
    temperature (°C), and 1.0/0.0 per slowdown reason (`slowed:<reason>`) and for any (`slowed`)."""
    probe = {
        "gpu_util_pct": 100 * gauge(snapshot, "lorafleet_worker_gpu_utilization_ratio"),
        "sm_clock_mhz": gauge(snapshot, "lorafleet_worker_gpu_sm_clock_hertz") / 1e6,
        "memory_clock_mhz": gauge(snapshot, "lorafleet_worker_gpu_memory_clock_hertz") / 1e6,
        "power_w": gauge(snapshot, "lorafleet_worker_gpu_power_watts"),
        "temperature_c": gauge(snapshot, "lorafleet_worker_gpu_temperature_celsius"),
    }
    slowed = {reason: math.nan for reason in SLOWDOWN_REASONS}
    for (name, labels), value in snapshot.items():
        if name == "lorafleet_worker_gpu_clocks_slowed":
            slowed[dict(labels)["reason"]] = value
    probe |= {f"slowed:{reason}": value for reason, value in slowed.items()}
    read = [value for value in slowed.values() if not math.isnan(value)]
    probe["slowed"] = float(any(read)) if read else math.nan
    return probe


@contextmanager
def sampled_each_second(probe: Callable[[], Probe]) -> Iterator[list[tuple[float, Probe]]]:
    """Read `probe` at once and then once a second on a thread of its own while the block runs; the
    list fills with (unix s, reading). For a run in this process, as the load client samples the stack's."""
    readings: list[tuple[float, Probe]] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            readings.append((time.time(), probe()))
            if stop.wait(1.0):
                return

    thread = threading.Thread(target=sample, name="device-sampler", daemon=True)
    thread.start()
    try:
        yield readings
    finally:
        stop.set()
        thread.join()


@dataclass(frozen=True, slots=True)
class DeviceClocks:
    """The device through one run: means over its once-a-second readings."""

    samples: int
    sm_clock_mhz: float
    memory_clock_mhz: float
    power_w: float
    temperature_c: float
    slowed_pct: float  # readings with any slowdown reason active
    reasons_pct: dict[str, float]  # per reason seen at least once, the readings it was active in


def device_clocks(probes: list[tuple[float, Probe]]) -> DeviceClocks | None:
    """None where no reading had a clock (a CPU worker, or a run too short for one)."""
    readings = [p for _, p in probes if not math.isnan(p.get("sm_clock_mhz", math.nan))]
    if not readings:
        return None

    def mean(key: str) -> float:
        values = [p[key] for p in readings if not math.isnan(p[key])]
        return sum(values) / len(values) if values else math.nan

    reasons = {reason: 100 * mean(f"slowed:{reason}") for reason in SLOWDOWN_REASONS}
    return DeviceClocks(
        samples=len(readings),
        sm_clock_mhz=mean("sm_clock_mhz"),
        memory_clock_mhz=mean("memory_clock_mhz"),
        power_w=mean("power_w"),
        temperature_c=mean("temperature_c"),
        slowed_pct=100 * mean("slowed"),
        reasons_pct={reason: pct for reason, pct in reasons.items() if pct > 0},
    )
