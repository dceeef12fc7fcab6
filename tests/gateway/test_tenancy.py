"""A tenant sees only its own jobs and adapters: another tenant's look exactly like missing ones."""

from __future__ import annotations

import time

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from shared import keys
from shared.schema import JobRecord, JobStatus
from tests.gateway.fleet import Fleet, submit

MISSING_JOB = "job_0123456789abcdef0123456789abcdef"
JOB_NOT_FOUND = (404, {"code": "job_not_found", "message": "job not found"})


async def error_of(response: ClientResponse) -> tuple[int, dict]:
    return response.status, (await response.json())["error"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/jobs/{}"), ("GET", "/v1/jobs/{}?wait=30"), ("POST", "/v1/jobs/{}/cancel")],
    ids=["get", "wait", "cancel"],
)
async def test_other_tenants_job_looks_missing(client: TestClient, fleet: Fleet, method: str, path: str) -> None:
    job_id = (await submit(client, fleet, "acme"))["id"]

    theirs = await client.request(method, path.format(job_id), headers=fleet.auth("globex"))
    missing = await client.request(method, path.format(MISSING_JOB), headers=fleet.auth("globex"))

    assert await error_of(theirs) == await error_of(missing) == JOB_NOT_FOUND


async def test_other_tenant_cannot_cancel_a_job(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet, "acme"))["id"]

    await client.post(f"/v1/jobs/{job_id}/cancel", headers=fleet.auth("globex"))

    record = JobRecord.from_hash(await fleet.redis.hgetall(keys.job(job_id)))
    assert record.status is JobStatus.QUEUED


@pytest.mark.parametrize("job_id", ["nope", "job_" + "g" * 32, "job_" + "0" * 31], ids=["short", "not-hex", "length"])
async def test_malformed_job_id_is_not_found(client: TestClient, fleet: Fleet, job_id: str) -> None:
    response = await client.get(f"/v1/jobs/{job_id}", headers=fleet.auth("acme"))

    assert await error_of(response) == JOB_NOT_FOUND


async def test_other_tenants_adapter_looks_missing(client: TestClient, fleet: Fleet) -> None:
    theirs = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "adapter": "globex-legal"}, headers=fleet.auth("acme")
    )
    missing = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "adapter": "no-such-adapter"}, headers=fleet.auth("acme")
    )

    theirs_status, theirs_error = await error_of(theirs)
    missing_status, missing_error = await error_of(missing)
    assert theirs_status == missing_status == 404
    assert theirs_error == {
        "code": "adapter_not_found",
        "message": "adapter 'globex-legal' not found",
        "param": "adapter",
    }
    assert missing_error == {**theirs_error, "message": "adapter 'no-such-adapter' not found"}
    assert await fleet.redis.xlen(keys.queue("tiny")) == 0


async def test_other_tenants_adapter_for_another_model_still_looks_missing(client: TestClient, fleet: Fleet) -> None:
    await fleet.add_adapter("globex-other", "globex", "other")

    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "adapter": "globex-other"}, headers=fleet.auth("acme")
    )

    assert (await error_of(response))[1]["code"] == "adapter_not_found"


async def test_waiting_on_another_tenants_job_fails_at_once(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet, "acme"))["id"]

    started = time.monotonic()
    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": "30"}, headers=fleet.auth("globex"))

    assert response.status == 404
    assert time.monotonic() - started < 0.5
