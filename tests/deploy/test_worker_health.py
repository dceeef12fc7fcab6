"""lorafleet-worker-health (deploy/docker/worker_health.py): the worker containers' readiness check
reads the heartbeat hash a worker writes, against a real Redis."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest
import redis

from shared import keys
from tests.deploy.conftest import DEPLOY

SCRIPT = DEPLOY / "docker" / "worker_health.py"


def load_script():
    spec = importlib.util.spec_from_file_location("worker_health", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def beat(redis_url: str, worker_id: str, *, age_s: float) -> None:
    """A heartbeat as worker/service.py writes it, `age_s` seconds old."""
    client = redis.Redis.from_url(redis_url)
    updated_ms = int((time.time() - age_s) * 1000)
    client.hset(keys.worker(worker_id), mapping={"models": '["demo"]', "updated_ms": updated_ms})
    client.close()


def run_check(redis_url: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", **({"REDIS_URL": redis_url} if redis_url else {})}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env={**env, "PYTHONPATH": str(DEPLOY.parent)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_fresh_heartbeat_is_healthy(redis_url: str):
    beat(redis_url, "pod-a", age_s=1)
    result = run_check(redis_url, "--worker-id", "pod-a")
    assert result.returncode == 0, result.stderr


def test_a_missing_heartbeat_is_not(redis_url: str):
    beat(redis_url, "pod-a", age_s=1)
    result = run_check(redis_url, "--worker-id", "pod-b")
    assert result.returncode == 1
    assert "no heartbeat from worker 'pod-b'" in result.stderr


def test_a_stale_heartbeat_is_not(redis_url: str):
    beat(redis_url, "pod-a", age_s=30)
    result = run_check(redis_url, "--worker-id", "pod-a", "--max-age-s", "10")
    assert result.returncode == 1
    assert "last beat" in result.stderr


def test_the_worker_id_defaults_to_the_hostname(redis_url: str, monkeypatch: pytest.MonkeyPatch):
    module = load_script()
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr(module.socket, "gethostname", lambda: "pod-c")
    beat(redis_url, "pod-c", age_s=0)
    assert module.main([]) == 0


def test_unreachable_redis_is_unhealthy_and_missing_config_is_an_error():
    assert run_check("redis://127.0.0.1:1/0", "--worker-id", "pod-a").returncode == 1
    assert run_check(None, "--worker-id", "pod-a").returncode == 2
