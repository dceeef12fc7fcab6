"""PNG plots of a benchmark run, from its rows and per-run token timelines.

loadtest/report.py plots Locust histories (closed-loop users over time); an open-loop run is
described by its offered load instead, so these plots put offered load on the x axis and draw
the ideal throughput and the TTFT objective beside the measurements.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen before pyplot loads

from bench.e2e.client import RunRecord
from bench.e2e.summary import TTFT_SLO_MS, RunSummary

_COLORS = {"zipf": "tab:orange", "base": "tab:blue"}


def plot_load(rows: list[RunSummary], output_tokens: int, path: Path) -> None:
    """Output tok/s and TTFT p50/p99 against offered load, one line per mode."""
    figure, (tput_axes, ttft_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    loads = sorted({r.offered_rps for r in rows if r.phase == "load"})
    if loads:
        tput_axes.plot(loads, [x * output_tokens for x in loads], ":", color="gray", label="offered (ideal)")
    for mode, color in _COLORS.items():
        runs = sorted((r for r in rows if r.phase == "load" and r.mode == mode), key=lambda r: r.offered_rps)
        if not runs:
            continue
        xs = [r.offered_rps for r in runs]
        tput_axes.plot(xs, [r.output_tok_s for r in runs], "o-", color=color, label=mode)
        ttft_axes.plot(xs, [r.ttft_p50_ms for r in runs], "o--", color=color, label=f"{mode} p50")
        ttft_axes.plot(xs, [r.ttft_p99_ms for r in runs], "o-", color=color, label=f"{mode} p99")
    ttft_axes.axhline(TTFT_SLO_MS, color="red", linewidth=0.8, label="1 s objective")
    tput_axes.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="Throughput")
    ttft_axes.set(xlabel="offered load (requests/s)", ylabel="ms", title="Time to first token", yscale="log")
    tput_axes.legend(fontsize="small")
    ttft_axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_timeline(runs: list[tuple[RunSummary, RunRecord]], path: Path) -> None:
    """Per load run: output tokens/s (1 s bins) and the model's queue (queued + running) over time."""
    figure, (tput_axes, queue_axes) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), height_ratios=(3, 2))
    styles = ("-", "--", ":", "-.")
    loads = sorted({row.offered_rps for row, _ in runs})
    for row, record in runs:
        style = styles[loads.index(row.offered_rps) % len(styles)]
        label = f"{row.mode} {row.offered_rps:.1f} req/s"
        horizon = int(max(record.token_times_s, default=0.0)) + 1
        bins = [0] * horizon
        for t in record.token_times_s:
            bins[int(t)] += 1
        tput_axes.plot([i + 0.5 for i in range(horizon)], bins, style, color=_COLORS[row.mode], label=label)
        if record.probes:
            queue_axes.plot([t for t, _ in record.probes], [p["queue"] for _, p in record.probes], style,
                            color=_COLORS[row.mode])  # fmt: skip
    tput_axes.set(ylabel="output tokens/s", title="Throughput over each load run")
    queue_axes.set(xlabel="seconds since the run's start", ylabel="jobs queued + running")
    tput_axes.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
