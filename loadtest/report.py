"""Plots and a markdown summary from headless Locust runs' CSV files.

    locust -f loadtest/locustfile.py --headless ... --csv out/u16 [--csv-full-history]
    python loadtest/report.py out/u4 out/u16 out/u64 --out out/report [--row "job adapter"]

For each PREFIX it reads PREFIX_stats.csv, PREFIX_stats_history.csv and PREFIX_failures.csv, and
writes into --out:
- throughput.png: requests/s and failures/s over time (all requests), and the user count;
- latency.png: the 50th/95th/99th percentile response times of --row over time (rows other than
  "Aggregated" are in the history only with --csv-full-history);
- latency_vs_load.png, when several runs are given: --row's percentiles against each run's
  throughput, each point labelled with its user count;
- summary.md: per run, its load, every stats row, its failures, and the plots.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen before pyplot loads

AGGREGATED = "Aggregated"
PERCENTILES = ("50%", "95%", "99%")


@dataclass(frozen=True, slots=True)
class StatsRow:
    type: str
    name: str
    requests: int
    failures: int
    rps: float
    latency_ms: dict[str, float]  # percentile column ("50%") → milliseconds; absent when N/A


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    t_s: float  # since the run's first history line
    users: int
    name: str
    rps: float
    failures_per_s: float
    latency_ms: dict[str, float]


@dataclass(frozen=True, slots=True)
class Failure:
    method: str
    name: str
    error: str
    occurrences: int


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    stats: list[StatsRow]
    history: list[HistoryPoint]
    failures: list[Failure]

    def row(self, name: str) -> StatsRow:
        for row in self.stats:
            if row.name == name:
                return row
        raise ReportError(f"{self.label}: no stats row named {name!r} (rows: {[r.name for r in self.stats]})")

    def points(self, name: str) -> list[HistoryPoint]:
        return [point for point in self.history if point.name == name]

    @property
    def users(self) -> int:
        return max((point.users for point in self.history), default=0)

    @property
    def duration_s(self) -> float:
        return max((point.t_s for point in self.history), default=0.0)


class ReportError(Exception):
    """Missing or malformed input, with what to fix."""


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise ReportError(f"{path} is missing (was the run started with --csv {path.name.rsplit('_', 2)[0]}?)")
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _latencies(record: dict[str, str]) -> dict[str, float]:
    return {p: float(record[p]) for p in PERCENTILES if record.get(p) not in (None, "", "N/A")}


def load_run(prefix: str) -> Run:
    stats = [
        StatsRow(
            type=r["Type"],
            name=r["Name"],
            requests=int(r["Request Count"]),
            failures=int(r["Failure Count"]),
            rps=float(r["Requests/s"]),
            latency_ms=_latencies(r),
        )
        for r in _read_csv(Path(f"{prefix}_stats.csv"))
    ]
    records = _read_csv(Path(f"{prefix}_stats_history.csv"))
    start = min((int(r["Timestamp"]) for r in records), default=0)
    history = [
        HistoryPoint(
            t_s=float(int(r["Timestamp"]) - start),
            users=int(r["User Count"]),
            name=r["Name"],
            rps=float(r["Requests/s"]),
            failures_per_s=float(r["Failures/s"]),
            latency_ms=_latencies(r),
        )
        for r in records
    ]
    failures = [
        Failure(r["Method"], r["Name"], r["Error"], int(r["Occurrences"]))
        for r in _read_csv(Path(f"{prefix}_failures.csv"))
    ]
    return Run(label=Path(prefix).name, stats=stats, history=history, failures=failures)


def plot_throughput(runs: list[Run], path: Path) -> None:
    figure, (rate_axes, user_axes) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=(3, 1))
    for run in runs:
        points = run.points(AGGREGATED)
        times = [p.t_s for p in points]
        (line,) = rate_axes.plot(times, [p.rps for p in points], label=f"{run.label} requests/s")
        rate_axes.plot(times, [p.failures_per_s for p in points], "--", color=line.get_color(), label="failures/s")
        user_axes.step(times, [p.users for p in points], where="post", color=line.get_color(), label=run.label)
    rate_axes.set_ylabel("per second")
    rate_axes.set_title("Throughput (all requests)")
    rate_axes.legend(fontsize="small")
    user_axes.set_ylabel("users")
    user_axes.set_xlabel("seconds since start")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_latency(runs: list[Run], row: str, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(9, 5))
    styles = dict(zip(PERCENTILES, ("-", "--", ":"), strict=True))
    for run in runs:
        points = run.points(row)
        color = None
        for percentile, style in styles.items():
            timed = [(p.t_s, p.latency_ms[percentile]) for p in points if percentile in p.latency_ms]
            if not timed:
                continue
            (line,) = axes.plot(*zip(*timed, strict=True), style, color=color, label=f"{run.label} p{percentile[:-1]}")
            color = line.get_color()
    axes.set_title(f"Response time percentiles: {row}")
    axes.set_xlabel("seconds since start")
    axes.set_ylabel("ms")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_latency_vs_load(runs: list[Run], row: str, path: Path) -> None:
    ordered = sorted(runs, key=lambda run: run.row(AGGREGATED).rps)
    figure, axes = plt.subplots(figsize=(8, 5))
    for percentile in PERCENTILES:
        xs = [run.row(AGGREGATED).rps for run in ordered]
        ys = [run.row(row).latency_ms.get(percentile, math.nan) for run in ordered]
        axes.plot(xs, ys, "o-", label=f"p{percentile[:-1]}")
    for run in ordered:
        axes.annotate(
            f"{run.users} users",
            (run.row(AGGREGATED).rps, run.row(row).latency_ms.get("50%", math.nan)),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize="small",
        )
    axes.set_title(f"Response time of {row} against load")
    axes.set_xlabel("throughput, all requests (requests/s)")
    axes.set_ylabel("ms")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _ms(row: StatsRow, percentile: str) -> str:
    return f"{row.latency_ms[percentile]:.0f}" if percentile in row.latency_ms else "n/a"


def summary_markdown(runs: list[Run], row: str, images: list[str]) -> str:
    lines = ["# Load test report", ""]
    for run in runs:
        total = run.row(AGGREGATED)
        lines += [
            f"## {run.label}",
            "",
            f"{run.users} users for {run.duration_s:.0f} s: {total.requests} requests, {total.failures} failed, "
            f"{total.rps:.2f} requests/s; {row}: p50 {_ms(run.row(row), '50%')} ms, "
            f"p99 {_ms(run.row(row), '99%')} ms.",
            "",
            "| type | name | requests | failures | req/s | p50 ms | p95 ms | p99 ms |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r.type} | {r.name} | {r.requests} | {r.failures} | {r.rps:.2f} | "
            f"{_ms(r, '50%')} | {_ms(r, '95%')} | {_ms(r, '99%')} |"
            for r in run.stats
        ]
        lines.append("")
        if run.failures:
            lines += ["| method | name | error | occurrences |", "| --- | --- | --- | ---: |"]
            lines += [f"| {f.method} | {f.name} | {f.error} | {f.occurrences} |" for f in run.failures]
        else:
            lines.append("No failures.")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{Path(image).stem}]({image})" for image in images]
    return "\n".join(lines) + "\n"


def write_report(prefixes: list[str], out: Path, row: str = AGGREGATED) -> list[Path]:
    """Read the runs, write the plots and summary.md into `out`; returns the files written."""
    runs = [load_run(prefix) for prefix in prefixes]
    for run in runs:  # check every run has the row before writing anything
        run.row(row)
        if not run.points(row):
            raise ReportError(f"{run.label}: no history for {row!r} (rows but {AGGREGATED!r} need --csv-full-history)")
    out.mkdir(parents=True, exist_ok=True)
    images = ["throughput.png", "latency.png"]
    plot_throughput(runs, out / images[0])
    plot_latency(runs, row, out / images[1])
    if len(runs) > 1:
        images.append("latency_vs_load.png")
        plot_latency_vs_load(runs, row, out / images[2])
    (out / "summary.md").write_text(summary_markdown(runs, row, images))
    return [out / image for image in images] + [out / "summary.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="+", metavar="PREFIX", help="a run's --csv prefix")
    parser.add_argument("--out", type=Path, required=True, help="directory for the plots and summary.md")
    parser.add_argument("--row", default=AGGREGATED, help="stats row whose latency is plotted (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.prefixes, args.out, args.row)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
