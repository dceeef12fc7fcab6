"""GPU utilisation and memory of the worker's device, read from NVML (nvidia-ml-py) at scrape time.

Reading at scrape time costs the engine nothing, and the numbers are NVML's own (utilisation is the
share of the driver's last sample period in which a kernel ran). A worker on the CPU, or on a
machine where NVML does not start, registers no collector: its GPU series are simply absent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pynvml
import structlog
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)


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
    """Exports `lorafleet_worker_gpu_utilization_ratio` and `..._gpu_memory_{used,total}_bytes` for one GPU."""

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
