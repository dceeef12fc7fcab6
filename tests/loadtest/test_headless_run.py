"""A short headless Locust run against `lorafleet up` on the CPU: both user kinds (jobs and OpenAI
completions) finish without a failure, and report.py turns the run's CSV files into plots and a summary.

`up` runs as offline (no package index): its random-weight demo answers in milliseconds on a CPU, so
ten seconds hold many requests of each kind, and the offline fallback is exercised end to end."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.redis_server import free_port
from tests.e2e.processes import REPO_ROOT, lorafleet_process, wait_until

pytestmark = pytest.mark.slow

RUN_TIME_S = 10


def test_a_short_headless_run_has_no_failures_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    state_dir, port = tmp_path / "state", free_port()
    log = tmp_path / "up.log"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured index or local wheel directory
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    with lorafleet_process(["up", "--state-dir", str(state_dir), "--port", str(port)], log):
        wait_until(lambda: "ready in" in log.read_text(), timeout_s=120, what="lorafleet up to be ready", logs=[log])
        assert "serving a random-weight model instead" in log.read_text()
        prefix = tmp_path / "run"
        env = {
            **os.environ,
            "LORAFLEET_STATE_DIR": str(state_dir),
            "LORAFLEET_MAX_TOKENS": "8",
            "LORAFLEET_OPENAI_WEIGHT": "2",  # 4 users: 2 submit jobs, 2 call /v1/completions
            "LORAFLEET_JOB_WEIGHT": "2",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        locust = subprocess.run(
            [
                sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
                "--host", f"http://127.0.0.1:{port}", "--headless", "-u", "4", "-r", "4", "-t", f"{RUN_TIME_S}s",
                "--csv", str(prefix), "--csv-full-history", "--only-summary", "--loglevel", "WARNING",
            ],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIME_S + 30,
        )  # fmt: skip
    output = locust.stdout[-3000:] + locust.stderr[-3000:]
    assert locust.returncode == 0, output  # locust exits 1 when any request failed

    with open(f"{prefix}_stats.csv", newline="") as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    assert int(rows["Aggregated"]["Failure Count"]) == 0, output
    assert int(rows["job adapter"]["Request Count"]) >= 1, output
    assert {"POST /v1/completions", "POST /v1/completions stream"} & rows.keys(), output
    assert Path(f"{prefix}_failures.csv").read_text().count("\n") == 1, "failures.csv has more than its header"

    report = subprocess.run(
        [sys.executable, str(REPO_ROOT / "loadtest" / "report.py"), str(prefix), "--out", str(tmp_path / "report"),
         "--row", "job adapter"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    for name in ("throughput.png", "latency.png"):
        assert (tmp_path / "report" / name).read_bytes().startswith(b"\x89PNG"), name
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "4 users" in summary and "No failures." in summary
