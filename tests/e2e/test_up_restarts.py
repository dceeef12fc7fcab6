"""`lorafleet up` keeps the fleet up: a worker or the gateway killed with SIGKILL is started again (the
log says so), and jobs submitted afterwards succeed."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from shared import keys
from shared.schema import JobStatus
from tests.e2e.processes import lorafleet_process, wait_until
from tests.fleet import MODEL, Fleet, jobs_for

pytestmark = pytest.mark.slow


def child_pid(log: Path, name: str) -> int | None:
    """The pid `up` last started child `name` as, from its log."""
    pid = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"child":"{name}"' in line:
            event = json.loads(line)
            if event["event"] in ("started", "restarted"):
                pid = event["pid"]
    return pid


def gateway_ready(fleet: Fleet) -> bool:
    try:
        with urllib.request.urlopen(f"{fleet.url}/readyz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def test_up_restarts_a_child_killed_with_sigkill_and_jobs_still_succeed(fleet: Fleet, tmp_path: Path):
    log = tmp_path / "up.log"
    command = ["up", "--state-dir", str(tmp_path / "state"), "--redis-url", fleet.redis_url]
    command += ["--port", str(fleet.port), "--model", f"{MODEL}={fleet.model_dir}"]
    command += ["--adapter-root", str(fleet.adapter_root), "--device", "cpu", "--worker-metrics-port", "0"]
    with lorafleet_process(command, log) as up, fleet.redis() as client:
        wait_until(lambda: "ready in" in log.read_text(), timeout_s=90, what="lorafleet up to be ready", logs=[log])
        for name in ("worker-cpu", "gateway"):
            pid = child_pid(log, name)
            workers_before = client.smembers(keys.WORKERS)
            os.kill(pid, signal.SIGKILL)

            wait_until(
                lambda name=name, pid=pid: child_pid(log, name) != pid,
                timeout_s=30,
                what=f"{name} restarted",
                logs=[log],
            )
            if name == "gateway":
                wait_until(lambda: gateway_ready(fleet), timeout_s=60, what="the gateway back", logs=[log])
            else:  # a new worker id beside the dead one's record (which expires)
                new = lambda before=workers_before: bool(client.smembers(keys.WORKERS) - before)  # noqa: E731
                wait_until(new, timeout_s=60, what="a new worker")
            job_ids = fleet.submit(jobs_for(4, max_tokens=8))
            records = fleet.wait_finished(job_ids, timeout_s=60)
            assert all(r.status is JobStatus.SUCCEEDED for r in records), records
            assert up.poll() is None
        exits = [json.loads(line) for line in log.read_text().splitlines() if '"event":"child_exited"' in line]
        assert [(e["child"], e["exit_code"]) for e in exits] == [("worker-cpu", -9), ("gateway", -9)]

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log.read_text()[-3000:]
