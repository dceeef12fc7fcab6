"""POST /v1/jobs/{id}/cancel: 200 with the job's state after the call."""

from __future__ import annotations

from aiohttp.test_utils import TestClient

from shared import keys
from shared.jobstore import JobStore
from shared.schema import JobRecord, JobStatus
from tests.gateway.fleet import Fleet, submit


async def test_cancel_queued_job(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]

    response = await client.post(f"/v1/jobs/{job_id}/cancel", headers=fleet.auth("acme"))

    assert response.status == 200
    body = await response.json()
    assert (body["id"], body["status"]) == (job_id, "canceled")
    assert body["timings"]["total_ms"] is not None
    record = JobRecord.from_hash(await fleet.redis.hgetall(keys.job(job_id)))
    assert record.status is JobStatus.CANCELED


async def test_canceled_job_is_skipped_by_the_worker(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]
    await client.post(f"/v1/jobs/{job_id}/cancel", headers=fleet.auth("acme"))

    status, _ = await JobStore(fleet.redis, job_ttl_s=60).start(job_id, "worker-1")

    assert status is JobStatus.CANCELED


async def test_cancel_twice_returns_canceled_both_times(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]

    first = await client.post(f"/v1/jobs/{job_id}/cancel", headers=fleet.auth("acme"))
    second = await client.post(f"/v1/jobs/{job_id}/cancel", headers=fleet.auth("acme"))

    assert (first.status, second.status) == (200, 200)
    assert await first.json() == await second.json()


async def test_cancel_of_a_finished_job_leaves_its_result(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]
    store = JobStore(fleet.redis, job_ttl_s=60)
    await store.start(job_id, "worker-1")
    await store.finish(job_id, JobStatus.SUCCEEDED, completion_tokens=2)

    response = await client.post(f"/v1/jobs/{job_id}/cancel", headers=fleet.auth("acme"))

    assert response.status == 200
    body = await response.json()
    assert body["status"] == "succeeded"
    assert body["usage"]["completion_tokens"] == 2


async def test_cancel_of_an_unknown_job_is_404(client: TestClient, fleet: Fleet) -> None:
    response = await client.post("/v1/jobs/job_0123456789abcdef0123456789abcdef/cancel", headers=fleet.auth("acme"))

    assert response.status == 404
    assert (await response.json())["error"]["code"] == "job_not_found"
