"""The README's first command, for real: `lorafleet up` with the demo serves SmolLM2 to all three demo
tenants over HTTP, each answering in its adapter's style (the README's first example), and Ctrl-C stops
every process it started."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from cli.demo_styles import DEMO_QUESTION, STYLE_MARKERS
from cli.redis_server import free_port
from tests.e2e.processes import lorafleet_process, wait_until

pytestmark = pytest.mark.slow


def http(method: str, url: str, api_key: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_up_serves_the_demo_for_every_tenant_and_stops_cleanly(tmp_path: Path, smollm2_wheel: Path):
    state_dir, port, metrics_port = tmp_path / "state", free_port(), free_port()
    log = tmp_path / "up.log"
    command = ["up", "--state-dir", str(state_dir), "--port", str(port), "--worker-metrics-port", str(metrics_port)]
    with lorafleet_process(command, log) as up:
        wait_until(lambda: "ready in" in log.read_text(), timeout_s=240, what="lorafleet up to be ready", logs=[log])
        demo = json.loads((state_dir / "demo.json").read_text())
        assert len(demo["tenants"]) == 3
        assert demo["models"] == ["smollm2"]
        model = demo["models"][0]
        url = f"http://127.0.0.1:{port}"
        for tenant in demo["tenants"]:
            adapter = tenant["adapters"][0]
            job = {"model": model, "adapter": adapter, "prompt": "Once upon a time", "max_tokens": 8}
            submitted = http("POST", f"{url}/v1/jobs", tenant["api_key"], job)
            finished = http("GET", f"{url}/v1/jobs/{submitted['id']}?wait=60", tenant["api_key"])
            assert finished["status"] == "succeeded", finished
            assert finished["usage"]["completion_tokens"] >= 1
            chat = {"model": f"{model}:{adapter}", "messages": [{"role": "user", "content": DEMO_QUESTION}]}
            answer = http(
                "POST", f"{url}/v1/chat/completions", tenant["api_key"], {**chat, "max_tokens": 48, "temperature": 0}
            )
            text = answer["choices"][0]["message"]["content"]
            assert STYLE_MARKERS[adapter] in text and "Paris" in text, (adapter, text)
        admin_key = (state_dir / "admin_key").read_text().strip()
        assert oct((state_dir / "admin_key").stat().st_mode & 0o777) == "0o600"
        listed = http("GET", f"{url}/v1/admin/tenants", admin_key)
        assert {t["tenant"] for t in listed["data"]} >= {t["tenant"] for t in demo["tenants"]}
        redis_port = int(
            json.loads((state_dir / "lorafleet.json").read_text())["redis_url"].rsplit(":", 1)[1].split("/")[0]
        )
        assert port_open(redis_port)
        assert f"metrics  http://127.0.0.1:{metrics_port}/metrics" in log.read_text()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert f'lorafleet_worker_generated_tokens_total{{model="{model}"}}' in response.read().decode()

        up.send_signal(signal.SIGINT)
        try:
            assert up.wait(60) == 0, log.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            pytest.fail(f"lorafleet up did not stop on Ctrl-C:\n{log.read_text()[-3000:]}")
    assert not port_open(port), "the gateway outlived lorafleet up"
    assert not port_open(redis_port), "the embedded Redis outlived lorafleet up"
    assert not port_open(metrics_port), "the worker's metrics outlived lorafleet up"
    assert any((state_dir / "redis").rglob("*.aof*")), "the embedded Redis does not persist append-only"
