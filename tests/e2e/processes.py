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


@contextmanager
def lorafleet_process(args: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Run `lorafleet ARGS` as a child; on exit send SIGTERM (then SIGKILL) and, if the test failed,
    leave its log at `log_path` (printed by `dump_log`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str, logs: list[Path] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")
        time.sleep(0.1)
