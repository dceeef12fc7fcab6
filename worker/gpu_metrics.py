"""GPU utilisation, memory, clocks, power, temperature and clock slowdowns of the worker's device,
read from NVML (nvidia-ml-py) at scrape time.

Reading at scrape time costs the engine nothing, and the numbers are NVML's own (utilisation is the
share of the driver's last sample period in which a kernel ran). A worker on the CPU, or on a
machine where NVML does not start, registers no collector: its GPU series are simply absent. The
clocks and what holds them down say whether a step ran slower because the device did (heat, the
power cap) rather than because the host fed it late.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pynvml
import structlog
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)

# The clock-event reasons that hold a loaded device's clocks down: nvml.h's nvmlClocksEventReason*
# (formerly ...ThrottleReason*) bits, written out because nvidia-ml-py names them only from 12.535
# and pyproject allows 12.0. The others NVML sets (idle, application clocks, sync boost, display)
# say why the clocks are what they are, not that the device is being slowed.
SLOWDOWN_REASONS: dict[str, int] = {
    "sw_power_cap": 0x4,
    "sw_thermal": 0x20,
    "hw_slowdown": 0x8,  # set with either of the two below, or alone
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}


def slowdowns(reasons: int) -> dict[str, bool]:
    """Which of SLOWDOWN_REASONS the bitmask `reasons` (nvmlDeviceGetCurrentClocksThrottleReasons) holds."""
    return {name: bool(reasons & bit) for name, bit in SLOWDOWN_REASONS.items()}


def cuda_index(device: str) -> int | None:
    """The CUDA ordinal of a torch device string ("cuda" is cuda:0); None for the CPU."""
    if device == "cuda":
        return 0
    if device.startswith("cuda:"):
        return int(device.removeprefix("cuda:"))
    return None


def nvml_id(ordinal: int, cuda_visible_devices: str | None) -> int | str:
    """How NVML names CUDA device `ordinal` of this process: an NVML index, or a UUID when
    CUDA_VISIBLE_DEVICES lists UUIDs. CUDA numbers only the visible devices, in the listed order."""
    if cuda_visible_devices is None:
        return ordinal
    entries = [entry.strip() for entry in cuda_visible_devices.split(",")]
    if ordinal >= len(entries) or not entries[ordinal]:
        raise LookupError(f"cuda:{ordinal} is not among CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")
    entry = entries[ordinal]
    return int(entry) if entry.isdigit() else entry


class GpuCollector(Collector):
    """Exports, for one GPU, `lorafleet_worker_gpu_utilization_ratio`, `..._gpu_memory_{used,total}_bytes`,
    `..._gpu_{sm,memory}_clock_hertz`, `..._gpu_power_watts`, `..._gpu_temperature_celsius` and
    `..._gpu_clocks_slowed{reason}` (1 while that reason of SLOWDOWN_REASONS holds the clocks down, else 0)."""

    def __init__(self, handle: object, index: int) -> None:
        self._handle = handle
        self._gpu = str(index)  # NVML's index: what nvidia-smi and DCGM call the device

    @classmethod
    def for_device(cls, device: str) -> GpuCollector | None:
        ordinal = cuda_index(device)
        if ordinal is None:
            return None
        try:
            pynvml.nvmlInit()  # ref-counted by NVML; held for the life of the process
            which = nvml_id(ordinal, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if isinstance(which, int):
                handle = pynvml.nvmlDeviceGetHandleByIndex(which)
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(which)
            return cls(handle, pynvml.nvmlDeviceGetIndex(handle))
        except (pynvml.NVMLError, LookupError) as exc:
            log.warning("gpu_metrics_unavailable", device=device, error=str(exc))
            return None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            utilization = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        except pynvml.NVMLError as exc:  # a lost GPU must not break the scrape of everything else
            log.warning("gpu_metrics_read_failed", gpu=self._gpu, error=str(exc))
            return
        busy = GaugeMetricFamily(
            "lorafleet_worker_gpu_utilization_ratio", "share of NVML's last sample period a kernel ran", labels=["gpu"]
        )
        busy.add_metric([self._gpu], utilization.gpu / 100.0)
        used = GaugeMetricFamily("lorafleet_worker_gpu_memory_used_bytes", "device memory in use", labels=["gpu"])
        used.add_metric([self._gpu], memory.used)
        total = GaugeMetricFamily("lorafleet_worker_gpu_memory_total_bytes", "device memory", labels=["gpu"])
        total.add_metric([self._gpu], memory.total)
        yield from (busy, used, total)
        yield from self._clock_state()

    def _clock_state(self) -> Iterator[GaugeMetricFamily]:
        """Read apart from utilisation and memory: a device that cannot report power (some virtual
        GPUs answer NOT_SUPPORTED) still exports those."""
        try:
            sm_mhz = pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM)
            memory_mhz = pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_MEM)
            power_mw = pynvml.nvmlDeviceGetPowerUsage(self._handle)
            celsius = pynvml.nvmlDeviceGetTemperature(self._handle, pynvml.NVML_TEMPERATURE_GPU)
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self._handle)  # the name every version has
        except pynvml.NVMLError as exc:
            log.warning("gpu_clock_metrics_read_failed", gpu=self._gpu, error=str(exc))
            return
        sm = GaugeMetricFamily("lorafleet_worker_gpu_sm_clock_hertz", "SM clock", labels=["gpu"])
        sm.add_metric([self._gpu], sm_mhz * 1e6)
        memory = GaugeMetricFamily("lorafleet_worker_gpu_memory_clock_hertz", "memory clock", labels=["gpu"])
        memory.add_metric([self._gpu], memory_mhz * 1e6)
        power = GaugeMetricFamily("lorafleet_worker_gpu_power_watts", "power draw", labels=["gpu"])
        power.add_metric([self._gpu], power_mw / 1000.0)
        temperature = GaugeMetricFamily("lorafleet_worker_gpu_temperature_celsius", "die temperature", labels=["gpu"])
        temperature.add_metric([self._gpu], celsius)
        slowed = GaugeMetricFamily(
            "lorafleet_worker_gpu_clocks_slowed", "1 while this reason holds the clocks down", labels=["gpu", "reason"]
        )
        for reason, active in slowdowns(reasons).items():
            slowed.add_metric([self._gpu, reason], float(active))
        yield from (sm, memory, power, temperature, slowed)
