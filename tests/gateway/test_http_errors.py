"""Every error is JSON: unknown routes, wrong methods, unexpected exceptions; request ids on every response."""

from __future__ import annotations

import re

import pytest
from aiohttp.test_utils import TestClient
from structlog.testing import capture_logs

from shared import keys
from tests.gateway.fleet import Fleet, submit


async def test_unknown_route_is_json_404(client: TestClient) -> None:
    response = await client.get("/v2/nothing-here")

    assert response.status == 404
    assert response.content_type == "application/json"
    assert (await response.json())["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("GET", "/v1/jobs", "POST"), ("DELETE", "/v1/jobs/job_1", "GET"), ("GET", "/v1/jobs/job_1/cancel", "POST")],
)
async def test_wrong_method_is_json_405_with_allow(client: TestClient, method: str, path: str, allowed: str) -> None:
    response = await client.request(method, path)

    assert response.status == 405
    assert allowed in response.headers["Allow"]
    assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_unexpected_exception_is_500_without_internals(client: TestClient, fleet: Fleet) -> None:
    job_id = "job_" + "a" * 32
    # a record no JobRecord can decode: the view fails in a way no client input can cause
    await fleet.redis.hset(keys.job(job_id), mapping={"job_id": job_id, "tenant": "acme", "status": "exploded"})

    with capture_logs() as logs:
        response = await client.get(f"/v1/jobs/{job_id}", headers=fleet.auth("acme"))

    assert response.status == 500
    text = await response.text()
    request_id = response.headers["X-Request-ID"]
    assert (await response.json())["error"] == {
        "code": "internal_error",
        "message": f"internal error (request id {request_id})",
    }
    assert "Traceback" not in text
    assert "exploded" not in text
    [logged] = [entry for entry in logs if entry["event"] == "unhandled_error"]
    assert logged["log_level"] == "error"
    assert logged["exc_info"] is True
    await submit(client, fleet)  # still serving


async def test_client_request_id_is_echoed(client: TestClient, fleet: Fleet) -> None:
    ok = await client.get("/healthz", headers={"X-Request-ID": "trace-7.a:b"})
    error = await client.get("/v1/jobs/job_x", headers={"X-Request-ID": "trace-8"})

    assert ok.headers["X-Request-ID"] == "trace-7.a:b"
    assert error.headers["X-Request-ID"] == "trace-8"


@pytest.mark.parametrize("supplied", ["has spaces", "x" * 129, "<script>"])
async def test_unsafe_request_id_is_replaced(client: TestClient, supplied: str) -> None:
    response = await client.get("/healthz", headers={"X-Request-ID": supplied})

    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-ID"])
