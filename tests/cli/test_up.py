"""`lorafleet up` refuses what it cannot do before starting anything, and its banner tells a person
how to use the fleet. (The full stack under `up` is exercised by the end-to-end tests.)"""

from __future__ import annotations

import fcntl
import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from cli.banner import lorafleet_command, startup_banner
from cli.demo import DemoTenant
from cli.demo_styles import DEMO_QUESTION
from cli.redis_server import free_port
from shared.config import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_up(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", "up", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_busy_gateway_port_is_refused_naming_the_flag_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = run_up("--state-dir", str(tmp_path), "--port", str(port))

    assert result.returncode == 2
    assert f"error: --port: 127.0.0.1:{port} is already in use" in result.stderr
    assert not (tmp_path / "redis").exists()
    assert result.stdout == ""


def test_a_busy_worker_metrics_port_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = run_up("--state-dir", str(tmp_path), "--port", str(free_port()), "--worker-metrics-port", str(port))

    assert result.returncode == 2
    assert f"error: --worker-metrics-port: 127.0.0.1:{port} is already in use" in result.stderr
    assert not (tmp_path / "redis").exists()


def test_a_second_up_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    with (tmp_path / "up.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `up` holds it
        result = run_up("--state-dir", str(tmp_path))

    assert result.returncode == 1
    assert "another `lorafleet up` is running" in result.stderr
    assert not (tmp_path / "redis").exists()


def test_the_banner_gives_the_url_each_demo_key_and_commands_that_parse(tmp_path: Path) -> None:
    tenants = [DemoTenant("acme", "lf_acme_key", ["acme-support"]), DemoTenant("globex", "lf_globex_key", ["g"])]
    banner = startup_banner(
        gateway_url="http://127.0.0.1:8123",
        redis_url="redis://127.0.0.1:6400/0",
        embedded_redis=True,
        state_dir=tmp_path,
        models=[ModelSpec("smollm2", tmp_path / "models" / "smollm2")],
        workers=["worker-cpu"],
        worker_metrics=["http://127.0.0.1:9200/metrics"],
        demo_tenants=tenants,
    )

    assert "http://127.0.0.1:8123" in banner and "redis://127.0.0.1:6400/0" in banner
    assert "lf_acme_key" in banner and "lf_globex_key" in banner
    assert "metrics  http://127.0.0.1:9200/metrics" in banner
    chat = shlex.split(next(line for line in banner.splitlines() if "/v1/chat/completions" in line))
    assert chat[:3] == ["curl", "-s", "http://127.0.0.1:8123/v1/chat/completions"]
    assert "Authorization: Bearer lf_acme_key" in chat
    assert json.loads(chat[chat.index("-d") + 1]) == {
        "model": "smollm2:acme-support",
        "messages": [{"role": "user", "content": DEMO_QUESTION}],
        "max_tokens": 48,
        "temperature": 0,
    }
    curl = shlex.split(next(line for line in banner.splitlines() if "/v1/jobs " in line))
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == "smollm2" and body["adapter"] == "acme-support"
    submit = shlex.split(next(line for line in banner.splitlines() if " submit " in line))
    assert submit[-1] == body["prompt"] and submit[submit.index("--max-tokens") + 1] == str(body["max_tokens"])


def test_the_banners_lorafleet_command_runs_without_lorafleet_on_path(tmp_path: Path) -> None:
    """`make up` runs .venv/bin/lorafleet without activating the venv: the banner's commands must not
    rely on PATH."""
    command = lorafleet_command()
    assert Path(command).is_file(), command
    result = subprocess.run(
        [command, "--help"], cwd=Path.cwd(), env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "submit" in result.stdout
