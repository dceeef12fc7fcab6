"""loadtest/report.py on small Locust-shaped CSV files: plots, the summary's numbers, input errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.report import ReportError, main, write_report

STATS_HEADER = (
    "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
    "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%"
)
HISTORY_HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%,"
    "Total Request Count,Total Failure Count,Total Median Response Time,Total Average Response Time,"
    "Total Min Response Time,Total Max Response Time,Total Average Content Size"
)


def percentiles(p50: int, p95: int, p99: int) -> str:
    return f"{p50},{p50},{p50},{p50},{p95},{p95},{p99},{p99},{p99},{p99},{p99}"


def write_run(prefix: Path, *, users: int, rps: float, p50: int, failures: int = 0) -> str:
    job = f"JOB,job adapter,{int(rps * 10)},{failures},{p50},{p50},1,{p50 * 3},8,{rps},0.0,"
    total = f",Aggregated,{int(rps * 20)},{failures},{p50},{p50},1,{p50 * 3},8,{rps * 2},0.0,"
    prefix.with_name(f"{prefix.name}_stats.csv").write_text(
        "\n".join([STATS_HEADER, job + percentiles(p50, p50 * 2, p50 * 3), total + percentiles(p50, p50, p50)]) + "\n"
    )
    history = [HISTORY_HEADER, f"100,0,,Aggregated,0,0,{','.join(['N/A'] * 11)},0,0,0,0,0,0,0"]
    for t in (101, 102, 103):
        history.append(f"{t},{users},JOB,job adapter,{rps},0,{percentiles(p50, p50 * 2, p50 * 3)},1,0,1,1,1,1,1")
        history.append(f"{t},{users},,Aggregated,{rps * 2},0,{percentiles(p50, p50, p50)},1,0,1,1,1,1,1")
    prefix.with_name(f"{prefix.name}_stats_history.csv").write_text("\n".join(history) + "\n")
    failure_rows = [f"POST,POST /v1/jobs,HTTPError('429'),{failures}"] if failures else []
    prefix.with_name(f"{prefix.name}_failures.csv").write_text(
        "\n".join(["Method,Name,Error,Occurrences", *failure_rows]) + "\n"
    )
    return str(prefix)


def is_png(path: Path) -> bool:
    return path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_one_run_gives_throughput_and_latency_plots_and_a_summary(tmp_path: Path):
    run = write_run(tmp_path / "u4", users=4, rps=2.5, p50=400)
    written = write_report([run], tmp_path / "report", row="job adapter")
    assert [p.name for p in written] == ["throughput.png", "latency.png", "summary.md"]
    assert all(is_png(p) for p in written[:2])
    summary = written[2].read_text()
    assert "4 users for 3 s: 50 requests, 0 failed, 5.00 requests/s; job adapter: p50 400 ms, p99 1200 ms." in summary
    assert "| JOB | job adapter | 25 | 0 | 2.50 | 400 | 800 | 1200 |" in summary
    assert "No failures." in summary
    assert "![latency](latency.png)" in summary


def test_several_runs_add_latency_against_load_and_list_failures(tmp_path: Path):
    runs = [
        write_run(tmp_path / "u4", users=4, rps=2.0, p50=300),
        write_run(tmp_path / "u16", users=16, rps=6.0, p50=900, failures=3),
    ]
    written = write_report(runs, tmp_path / "report")
    assert is_png(tmp_path / "report" / "latency_vs_load.png")
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "## u4" in summary and "## u16" in summary
    assert "| POST | POST /v1/jobs | HTTPError('429') | 3 |" in summary
    assert written[-1].name == "summary.md"


def test_a_row_missing_from_the_history_is_refused_before_anything_is_written(tmp_path: Path):
    run = write_run(tmp_path / "u4", users=4, rps=2.0, p50=300)
    history = tmp_path / "u4_stats_history.csv"
    history.write_text("\n".join(line for line in history.read_text().splitlines() if "job adapter" not in line))
    with pytest.raises(ReportError, match="--csv-full-history"):
        write_report([run], tmp_path / "report", row="job adapter")
    assert not (tmp_path / "report").exists()


def test_missing_csv_files_exit_2_with_the_file_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "report")]) == 2
    assert "nothing_stats.csv is missing" in capsys.readouterr().err
