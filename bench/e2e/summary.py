"""From a run's samples to its row: throughput, latency percentiles, failures, where the time went;
then the issue's targets over all rows, and the table printed last."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.e2e.client import Sample
from bench.e2e.device_clocks import DeviceClocks, Probe, device_clocks
from bench.e2e.floor import AdapterFloor
from bench.e2e.worker_metrics import WorkerStats

TTFT_SLO_MS = 1000.0
OVERHEAD_TARGET_MS = 5.0  # gateway + queue over the engine alone, at p50


@dataclass(frozen=True, slots=True)
class JobTimes:
    """A job record's timestamps (unix ms), written by the gateway (created) and the worker. They are
    whole milliseconds, truncated: set against the client's own clock, a stamp stands for the middle
    of its millisecond (`_stamp_ms`), or a sub-millisecond submit would read as negative."""

    created_ms: int
    started_ms: int
    first_token_ms: int
    finished_ms: int


def _stamp_ms(truncated_ms: int) -> float:
    """The middle of the millisecond a record's whole-ms stamp covers: unbiased against a float clock."""
    return truncated_ms + 0.5


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


@dataclass(frozen=True, slots=True)
class RunSummary:
    phase: str  # calibration | load | engine-alone
    mode: str  # zipf | base
    offered_rps: float  # 0 for a closed-loop run
    requests: int
    failed: int  # did not succeed (HTTP error, failed job, or unfinished when the run gave up)
    duration_s: float  # first arrival to last end
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    send_lag_p99_ms: float  # the client's own lateness: sent - planned arrival
    submit_p50_ms: float  # client sent -> job record created (HTTP, auth, tokenize, the create script)
    queue_p50_ms: float  # record created -> a worker started it (the stream and the worker's intake)
    server_ttft_p50_ms: float  # record created -> the engine's first token
    delivery_p50_ms: float  # result stored -> the client read the end event
    gpu_util_pct: float  # mean of the worker's NVML utilisation, sampled once a second (nan: not sampled)
    distinct_adapters: int
    peak_queue: int  # most entries seen in the model's interactive streams, shared and routed (queued + running)
    failures: dict[str, int]  # status -> count, for the failed ones
    worker: WorkerStats | None  # from the worker's metrics, before and after the run
    clocks: DeviceClocks | None  # the device's clocks, power and slowdowns, sampled once a second (None: no GPU)


def summarize(
    phase: str, mode: str, offered_rps: float, samples: list[Sample], *, start_unix_s: float = 0.0,
    job_times: dict[str, JobTimes] | None = None, probes: list[tuple[float, Probe]] = (),
    worker: WorkerStats | None = None,
) -> RunSummary:  # fmt: skip
    ok = [s for s in samples if s.ok]
    failures: dict[str, int] = {}
    for sample in samples:
        if not sample.ok:
            failures[sample.status] = failures.get(sample.status, 0) + 1
    ends = [s.end_s for s in ok if s.end_s is not None]
    duration = (max(ends) - min(s.scheduled_s for s in samples)) if ends else math.nan
    tokens = sum(s.completion_tokens for s in ok)

    def ms(values: list[float | None], q: float) -> float:
        return percentile([1000 * v for v in values if v is not None], q)

    times = [job_times[s.job_id] for s in ok if job_times and s.job_id in job_times]
    sent_ms = {s.job_id: 1000 * (start_unix_s + s.sent_s) for s in ok}
    end_ms = {s.job_id: 1000 * (start_unix_s + s.end_s) for s in ok if s.end_s is not None}
    ids = [s.job_id for s in ok if job_times and s.job_id in job_times]
    return RunSummary(
        phase=phase,
        mode=mode,
        offered_rps=offered_rps,
        requests=len(samples),
        failed=len(samples) - len(ok),
        duration_s=duration,
        output_tok_s=tokens / duration if ends and duration > 0 else 0.0,
        ttft_p50_ms=ms([s.ttft_s for s in ok], 50),
        ttft_p99_ms=ms([s.ttft_s for s in ok], 99),
        latency_p50_ms=ms([s.latency_s for s in ok], 50),
        latency_p99_ms=ms([s.latency_s for s in ok], 99),
        send_lag_p99_ms=ms([s.sent_s - s.scheduled_s for s in samples if s.sent_s], 99),
        submit_p50_ms=percentile([_stamp_ms(t.created_ms) - sent_ms[i] for i, t in zip(ids, times, strict=True)], 50),
        queue_p50_ms=percentile([t.started_ms - t.created_ms for t in times], 50),
        server_ttft_p50_ms=percentile([t.first_token_ms - t.created_ms for t in times], 50),
        delivery_p50_ms=percentile([end_ms[i] - _stamp_ms(t.finished_ms) for i, t in zip(ids, times, strict=True)], 50),
        gpu_util_pct=_mean([p["gpu_util_pct"] for _, p in probes if not math.isnan(p["gpu_util_pct"])]),
        distinct_adapters=len({s.adapter for s in samples if s.adapter is not None}),
        peak_queue=int(max((p.get("queue", 0) for _, p in probes), default=0)),  # the replay has no stream
        failures=failures,
        worker=worker,
        clocks=device_clocks(list(probes)),
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def window_tok_s(token_times_s: list[float], start_s: float, end_s: float) -> float:
    """Output tokens per second that arrived within [start_s, end_s)."""
    return sum(start_s <= t < end_s for t in token_times_s) / (end_s - start_s)


@dataclass(frozen=True, slots=True)
class Verdict:
    target: str
    measured: str
    met: bool | None  # None: not measured


def _highest_within_slo(rows: list[RunSummary], mode: str) -> RunSummary | None:
    passing = [r for r in rows if r.phase == "load" and r.mode == mode and r.ttft_p99_ms <= TTFT_SLO_MS]
    return max(passing, key=lambda r: r.offered_rps, default=None)


def _calibration(rows: list[RunSummary], mode: str) -> RunSummary | None:
    return next((r for r in rows if r.phase == "calibration" and r.mode == mode), None)


def verdicts(
    rows: list[RunSummary],
    capacity_rps: dict[str, float],
    overhead: tuple[RunSummary, RunSummary] | None,
    saturation_target: float,
    floor: AdapterFloor | None,
) -> list[Verdict]:
    """The issue's targets. `capacity_rps`: each mode's calibrated saturation; `overhead`: (stack
    run, engine-alone replay of the same plan); `floor`: the byte floor of the saturation ratio."""
    out = []
    zipf, base = _calibration(rows, "zipf"), _calibration(rows, "base")
    target = f"Zipf saturation ≥ {saturation_target}× base-only (closed loop)"
    if zipf is None or base is None or not base.output_tok_s:
        out.append(Verdict(target, "not calibrated", None))
    else:
        ratio = zipf.output_tok_s / base.output_tok_s
        beside = f"; {floor.describe()}" if floor is not None else ""
        measured = f"zipf {zipf.output_tok_s:.0f} / base {base.output_tok_s:.0f} tok/s = {ratio:.2f}×{beside}"
        out.append(Verdict(target, measured, ratio >= saturation_target))
    target = "Zipf p99 TTFT ≤ 1 s at the highest load where base-only keeps it"
    base_ok = _highest_within_slo(rows, "base")
    at_base_ok = [r for r in rows if base_ok and r.phase == "load" and r.offered_rps == base_ok.offered_rps]
    zipf_there = next((r for r in at_base_ok if r.mode == "zipf"), None)
    if base_ok is None or zipf_there is None:
        out.append(Verdict(target, "no base-only load kept p99 TTFT ≤ 1 s, or no Zipf run at it", None))
    else:
        measured = (
            f"at {base_ok.offered_rps:.1f} req/s: base p99 {base_ok.ttft_p99_ms:.0f} ms, "
            f"zipf p99 {zipf_there.ttft_p99_ms:.0f} ms"
        )
        out.append(Verdict(target, measured, zipf_there.ttft_p99_ms <= TTFT_SLO_MS))
    below = [r for r in rows if r.phase == "load" and r.offered_rps < capacity_rps.get(r.mode, math.inf)]
    failed = sum(r.failed for r in below)
    out.append(
        Verdict(
            "zero failed requests below saturation",
            f"{failed} failed of {sum(r.requests for r in below)} in {len(below)} runs below calibrated saturation",
            failed == 0 if below else None,
        )
    )
    if overhead is None:
        out.append(Verdict(f"gateway + queue ≤ {OVERHEAD_TARGET_MS:.0f} ms at p50", "not measured", None))
    else:
        stack, alone = overhead
        added = stack.latency_p50_ms - alone.latency_p50_ms
        measured = (
            f"p50 latency {stack.latency_p50_ms:.1f} (stack) - {alone.latency_p50_ms:.1f} (engine alone) = "
            f"{added:.1f} ms; p50 TTFT {stack.ttft_p50_ms:.1f} - {alone.ttft_p50_ms:.1f} ms{_step_times(stack, alone)}"
        )
        out.append(
            Verdict(f"gateway + queue ≤ {OVERHEAD_TARGET_MS:.0f} ms at p50", measured, added <= OVERHEAD_TARGET_MS)
        )
    return out


def _step_times(stack: RunSummary, alone: RunSummary) -> str:
    """The engine's mean step in the stack's worker and alone, at the same load: what of the added
    latency the engine itself loses inside the worker (its I/O thread beside it), and what is outside;
    and the device's clocks in both, which say whether the device or the host was slower."""
    if stack.worker is None or alone.worker is None:
        return ""
    clocks = ""
    if stack.clocks is not None and alone.clocks is not None:
        clocks = (
            f"; mean SM clock {stack.clocks.sm_clock_mhz:.0f} vs {alone.clocks.sm_clock_mhz:.0f} MHz, clocks slowed "
            f"in {stack.clocks.slowed_pct:.0f} vs {alone.clocks.slowed_pct:.0f}% of readings"
        )
    return (
        f"; mean step {stack.worker.step_ms:.2f} ms over {stack.worker.steps} steps (stack) vs "
        f"{alone.worker.step_ms:.2f} ms over {alone.worker.steps} (engine alone); the device idle between "
        f"steps, waiting for the host, {stack.worker.device_idle_ms:.3f} vs {alone.worker.device_idle_ms:.3f} ms a step"
        f"{clocks}"
    )


def table(rows: list[RunSummary], output_tokens: int) -> str:
    """The rows as a markdown table; `ideal` is offered load × output tokens (what an open loop can get)."""
    lines = [
        "| phase | mode | offered req/s | requests | failed | output tok/s | ideal tok/s | TTFT p50 ms "
        "| TTFT p99 ms | latency p50 ms | latency p99 ms | submit p50 ms | queue p50 ms | delivery p50 ms "
        "| GPU util % | peak queue |",
        "| --- | --- " + "| ---: " * 14 + "|",
    ]
    for r in rows:
        offered = f"{r.offered_rps:.1f}" if r.offered_rps else "closed"
        ideal = f"{r.offered_rps * output_tokens:.0f}" if r.offered_rps else "–"
        lines.append(
            f"| {r.phase} | {r.mode} | {offered} | {r.requests} | {r.failed} | {r.output_tok_s:.0f} | {ideal} "
            f"| {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.latency_p50_ms:.0f} | {r.latency_p99_ms:.0f} "
            f"| {r.submit_p50_ms:.1f} | {r.queue_p50_ms:.1f} | {r.delivery_p50_ms:.1f} | {r.gpu_util_pct:.0f} "
            f"| {r.peak_queue} |"
        )
    return "\n".join(lines)


def worker_table(rows: list[RunSummary]) -> str:
    """Where the worker's time went in each run (from its Prometheus counters)."""
    lines = [
        "| phase | mode | offered req/s | steps | step ms | seqs/step | tokens/step | adapters/step "
        "| adapter GPU hits % | adapter loads | load ms | preemptions | worker CPU ms/request | device idle ms/step |",
        "| --- | --- " + "| ---: " * 12 + "|",
    ]
    for r in rows:
        if r.worker is None:
            continue
        w = r.worker
        offered = f"{r.offered_rps:.1f}" if r.offered_rps else "closed"
        lines.append(
            f"| {r.phase} | {r.mode} | {offered} | {w.steps} | {w.step_ms:.1f} | {w.batch_seqs:.1f} "
            f"| {w.batch_tokens:.0f} | {w.batch_adapters:.1f} | {w.adapter_gpu_hit_pct:.1f} | {w.adapter_loads} "
            f"| {w.adapter_load_ms:.1f} "
            f"| {w.preemptions} | {1000 * w.cpu_s / r.requests if r.requests else math.nan:.2f} "
            f"| {w.device_idle_ms:.3f} |"
        )
    return "\n".join(lines)


def clocks_table(rows: list[RunSummary]) -> str:
    """The device through each run (from the worker's NVML gauges, once a second): a run whose steps
    are slower at the same load with lower clocks, or clocks held down, ran on a slower device."""
    lines = [
        "| phase | mode | offered req/s | readings | GPU util % | SM clock MHz | memory clock MHz | power W "
        "| temperature °C | clocks slowed % | by reason % |",
        "| --- | --- " + "| ---: " * 8 + "| --- |",
    ]
    for r in rows:
        if r.clocks is None:
            continue
        c = r.clocks
        offered = f"{r.offered_rps:.1f}" if r.offered_rps else "closed"
        reasons = ", ".join(f"{reason} {pct:.0f}" for reason, pct in c.reasons_pct.items()) or "–"
        lines.append(
            f"| {r.phase} | {r.mode} | {offered} | {c.samples} | {r.gpu_util_pct:.0f} | {c.sm_clock_mhz:.0f} "
            f"| {c.memory_clock_mhz:.0f} | {c.power_w:.0f} | {c.temperature_c:.1f} | {c.slowed_pct:.0f} | {reasons} |"
        )
    return "\n".join(lines)


def verdict_table(found: list[Verdict]) -> str:
    lines = ["| target | measured | met |", "| --- | --- | --- |"]
    marks = {True: "yes", False: "no", None: "not measured"}
    lines += [f"| {v.target} | {v.measured} | {marks[v.met]} |" for v in found]
    return "\n".join(lines)
