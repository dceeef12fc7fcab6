"""Real lorafleet processes for end-to-end tests: started with `python -m cli`, logs kept for failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def start_lorafleet(args: list[str], log_path: Path) -> subprocess.Popen:
    """`lorafleet ARGS` as a child writing to `log_path` (printed by `wait_until` when a wait fails)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:  # the child writes through its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM every one still running, all at once, then wait for each (SIGKILL past 30 s): their stops
    (a worker's takes up to its one-second read block) overlap instead of adding up."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def lorafleet_process(args: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Run `lorafleet ARGS` as a child; on exit send SIGTERM (then SIGKILL)."""
    process = start_lorafleet(args, log_path)
    try:
        yield process
    finally:
        stop_processes([process])


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str, logs: list[Path] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")
        time.sleep(0.1)
