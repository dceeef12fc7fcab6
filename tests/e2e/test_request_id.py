"""A request id travels with its job: the client's X-Request-ID is on the gateway's log line for the
submit (with the job id) and on the worker's lines for that job, in real processes' JSON logs."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.fleet import MODEL, TENANT, Fleet

pytestmark = pytest.mark.slow

REQUEST_ID = "trace-7f3a9c"


def log_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # not a structlog line (e.g. a library's plain-text warning)
    return lines


def test_the_clients_request_id_is_on_the_gateway_and_worker_lines_of_its_job(fleet: Fleet):
    fleet.start_gateway()
    fleet.start_worker("w1")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    request = urllib.request.Request(
        f"{fleet.url}/v1/jobs",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {fleet.api_keys[TENANT]}",
            "Content-Type": "application/json",
            "X-Request-ID": REQUEST_ID,
        },
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["X-Request-ID"] == REQUEST_ID
        job_id = json.loads(response.read())["id"]
    fleet.wait_finished([job_id], timeout_s=60)

    (submitted,) = [line for line in log_lines(fleet.log_of("gateway")) if line.get("request_id") == REQUEST_ID]
    assert (submitted["event"], submitted["job_id"], submitted["status"]) == ("request", job_id, 202)
    worker_lines = [line for line in log_lines(fleet.log_of("w1")) if line.get("job") == job_id]
    assert {line["event"] for line in worker_lines} >= {"job_started", "job_finished"}
    assert all(line["request_id"] == REQUEST_ID for line in worker_lines)
