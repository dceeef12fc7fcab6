"""bench/e2e's readings of the device: the NVML gauges of one scrape as a probe, a run's probes as its
means and slowdown shares, the in-process sampler, and the table. On a GPU, the worker's own collector
read through the same code."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from bench.e2e.client import Sample
from bench.e2e.device_clocks import device_clocks, device_probe, sampled_each_second
from bench.e2e.summary import clocks_table, summarize, verdicts
from bench.e2e.worker_metrics import WorkerStats, read_registry
from worker.gpu_metrics import SLOWDOWN_REASONS
from worker.metrics import WorkerMetrics


class _Exported(Collector):
    """Gauges named and labelled as worker/gpu_metrics.py exports them, at fixed values (there is no
    NVML on the CPU machine; the real collector is read by the GPU test below)."""

    def __init__(self, sm_mhz: float, watts: float, slowed: set[str]) -> None:
        self.sm_mhz, self.watts, self.slowed = sm_mhz, watts, slowed

    def collect(self):
        values = {
            "utilization_ratio": 0.97, "sm_clock_hertz": self.sm_mhz * 1e6, "memory_clock_hertz": 2619e6,
            "power_watts": self.watts, "temperature_celsius": 61.0,
        }  # fmt: skip
        for name, value in values.items():
            family = GaugeMetricFamily(f"lorafleet_worker_gpu_{name}", "", labels=["gpu"])
            family.add_metric(["0"], value)
            yield family
        slowed = GaugeMetricFamily("lorafleet_worker_gpu_clocks_slowed", "", labels=["gpu", "reason"])
        for reason in SLOWDOWN_REASONS:
            slowed.add_metric(["0", reason], float(reason in self.slowed))
        yield slowed


def probe_of(sm_mhz: float, watts: float, slowed: set[str] = frozenset()) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(_Exported(sm_mhz, watts, set(slowed)))
    return device_probe(read_registry(registry))


def test_a_probe_reads_the_clocks_in_mhz_and_any_active_slowdown():
    probe = probe_of(1980.0, 690.0, {"sw_power_cap"})
    assert probe["gpu_util_pct"] == pytest.approx(97.0)
    assert probe["sm_clock_mhz"] == pytest.approx(1980.0) and probe["memory_clock_mhz"] == pytest.approx(2619.0)
    assert (probe["power_w"], probe["temperature_c"]) == (690.0, 61.0)
    assert probe["slowed:sw_power_cap"] == 1.0 and probe["slowed:hw_thermal"] == 0.0 and probe["slowed"] == 1.0
    assert probe_of(1980.0, 400.0)["slowed"] == 0.0


def test_a_cpu_worker_has_no_device_readings():
    probe = device_probe(read_registry(WorkerMetrics(device="cpu").registry))
    assert all(math.isnan(value) for value in probe.values())
    assert device_clocks([(0.0, probe), (1.0, probe)]) is None


def test_a_runs_clocks_are_means_over_its_readings_and_shares_of_slowed_ones():
    probes = [(float(t), probe_of(1980.0, 600.0)) for t in range(3)] + [(3.0, probe_of(1760.0, 700.0, {"sw_thermal"}))]
    clocks = device_clocks(probes)
    assert clocks.samples == 4
    assert clocks.sm_clock_mhz == pytest.approx(1925.0) and clocks.power_w == pytest.approx(625.0)
    assert clocks.slowed_pct == 25.0 and clocks.reasons_pct == {"sw_thermal": 25.0}  # reasons never seen left out


def test_the_sampler_reads_at_once_and_stops_with_its_block():
    with sampled_each_second(lambda: {"n": 1.0}) as readings:
        pass
    assert [probe for _, probe in readings] == [{"n": 1.0}]  # one reading, taken before the block could end


def test_the_clocks_go_in_their_table_and_beside_the_step_times():
    done = Sample(0, None, 0.0, sent_s=0.0, first_token_s=0.1, end_s=1.0, status="succeeded", completion_tokens=8)
    hot = [(0.0, probe_of(1755.0, 700.0, {"sw_power_cap"})), (1.0, probe_of(1755.0, 700.0))]
    cool = [(0.0, probe_of(1980.0, 500.0))]
    stack = summarize("load", "base", 10.0, [done], probes=hot)
    alone = summarize("engine-alone", "base", 10.0, [done], probes=cool)
    cpu = summarize("load", "zipf", 10.0, [done])
    table = clocks_table([stack, cpu, alone])
    assert "| load | base | 10.0 | 2 | 97 | 1755 | 2619 | 700 | 61.0 | 50 | sw_power_cap 50 |" in table
    assert "| engine-alone | base | 10.0 | 1 | 97 | 1980 | 2619 | 500 | 61.0 | 0 | – |" in table
    assert "zipf" not in table  # no readings, no row

    steps = WorkerStats(100, 8.0, 32.0, 96.0, 0.0, 800, math.nan, 0, math.nan, 0, 1.0, 0.01)
    stack, alone = replace(stack, worker=steps), replace(alone, worker=steps)
    overhead = verdicts([stack, alone], {}, (stack, alone), 0.85, None)[-1]
    assert "mean SM clock 1755 vs 1980 MHz, clocks slowed in 50 vs 0% of readings" in overhead.measured


@pytest.mark.gpu
def test_the_workers_own_collector_reads_as_a_probe():
    probe = device_probe(read_registry(WorkerMetrics(device="cuda").registry))
    assert not any(math.isnan(value) for value in probe.values())
    assert probe["sm_clock_mhz"] > 100 and probe["power_w"] > 1 and probe["slowed"] in (0.0, 1.0)
