"""The worker's Prometheus endpoint (worker/metrics.py), read around and during each run (and the
same registry read in process, for the engine-alone replay).

Counters and histograms are read before and after a run and differenced, which says where the
worker's time went in that run alone: how many engine steps, how long each took, how full the
batch was, how often an adapter was already on the GPU and how long loads took. Gauges (GPU
utilisation, running and waiting sequences) are sampled once a second during the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.local_http import LOCAL_HTTP

Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) → value


def scrape(url: str) -> Snapshot:
    with LOCAL_HTTP.open(url, timeout=5.0) as response:
        return _parse(response.read().decode())


def read_registry(registry: CollectorRegistry) -> Snapshot:
    """What a scrape of a worker serving `registry` would read, from this process."""
    return _parse(generate_latest(registry).decode())


def _parse(text: str) -> Snapshot:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(snapshot: Snapshot, name: str, **labels: str) -> float:
    """The sum of the `name` samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample, have), value in snapshot.items() if sample == name and wanted <= set(have))


def gauge(snapshot: Snapshot, name: str) -> float:
    """One gauge's value (summed over its label sets); nan when the worker exports no such series."""
    values = [value for (sample, _), value in snapshot.items() if sample == name]
    return sum(values) if values else math.nan


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What the worker did between two scrapes."""

    steps: int
    step_ms: float  # mean wall time of an engine step
    batch_seqs: float  # mean sequences per step
    batch_tokens: float  # mean tokens per step (prefill chunks + decodes)
    batch_adapters: float  # mean distinct adapters per step (the LoRA kernels' cost grows with them)
    generated_tokens: int
    adapter_gpu_hit_pct: float  # adapter lookups that found it in a GPU slot
    adapter_loads: int  # lookups the GPU tier missed (each a load from pinned memory or disk)
    adapter_load_ms: float  # mean time of a load
    preemptions: int
    cpu_s: float  # the worker process's CPU time (all its threads)
    device_idle_ms: float  # mean idle time of the device between two back-to-back steps (nan: not measured, CPU)


def difference(before: Snapshot, after: Snapshot) -> WorkerStats:
    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    def ratio(numerator: float, denominator: float) -> float:
        return numerator / denominator if denominator else math.nan

    steps = delta("lorafleet_worker_step_seconds_count")
    hits, misses = (
        delta("lorafleet_worker_adapter_hits_total", tier="gpu"),
        delta("lorafleet_worker_adapter_misses_total", tier="gpu"),
    )
    return WorkerStats(
        steps=int(steps),
        step_ms=1000 * ratio(delta("lorafleet_worker_step_seconds_sum"), steps),
        batch_seqs=ratio(delta("lorafleet_worker_batch_size_sum"), delta("lorafleet_worker_batch_size_count")),
        batch_tokens=ratio(delta("lorafleet_worker_batch_tokens_sum"), delta("lorafleet_worker_batch_tokens_count")),
        batch_adapters=ratio(
            delta("lorafleet_worker_batch_adapters_sum"), delta("lorafleet_worker_batch_adapters_count")
        ),
        generated_tokens=int(delta("lorafleet_worker_generated_tokens_total")),
        adapter_gpu_hit_pct=100 * ratio(hits, hits + misses),
        adapter_loads=int(misses),
        adapter_load_ms=1000
        * ratio(
            delta("lorafleet_worker_adapter_load_seconds_sum"), delta("lorafleet_worker_adapter_load_seconds_count")
        ),
        preemptions=int(delta("lorafleet_worker_preemptions_total")),
        cpu_s=delta("process_cpu_seconds_total"),
        device_idle_ms=1000
        * ratio(delta("lorafleet_worker_device_idle_seconds_sum"), delta("lorafleet_worker_device_idle_seconds_count")),
    )
