"""run_gateway: serves HTTP until SIGTERM or SIGINT, then exits cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_gateway_stops_cleanly_on_signal(redis_url: str, signum: signal.Signals) -> None:
    port = free_port()
    program = (
        "from gateway.main import run_gateway\n"
        "from shared.config import GatewayConfig\n"
        f"run_gateway(GatewayConfig(redis_url={redis_url!r}, port={port}))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", program], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until_serving(f"http://127.0.0.1:{port}/readyz", process)
        process.send_signal(signum)
        output, _ = process.communicate(timeout=15)
    finally:
        process.kill()

    assert process.returncode == 0, output
    assert "gateway_stopped" in output
