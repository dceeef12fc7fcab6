"""GET /v1/jobs/{id}: the job's view, and long-polling with ?wait= until the worker finishes it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.app import create_app
from gateway.state import REDIS
from shared.config import GatewayConfig
from shared.jobstore import JobStore
from shared.schema import FinishReason, JobError, JobOutput, JobStatus
from tests.gateway.fleet import LIMITS, Fleet, submit


async def finish_like_a_worker(fleet: Fleet, job_id: str) -> None:
    store = JobStore(fleet.redis, job_ttl_s=60)
    assert await store.start(job_id, "worker-1") == (JobStatus.RUNNING, 1)
    output = JobOutput(text=" the lazy dog", token_ids=(5, 11, 12), finish_reason=FinishReason.STOP)
    stored = await store.finish(
        job_id, JobStatus.SUCCEEDED, output=output, completion_tokens=3, first_token_ms=int(time.time() * 1000)
    )
    assert stored


async def test_queued_job_has_no_output_timings_or_error(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet, adapter="acme-support"))["id"]

    response = await client.get(f"/v1/jobs/{job_id}", headers=fleet.auth("acme"))

    assert response.status == 200
    assert await response.json() == {
        "id": job_id,
        "status": "queued",
        "model": "tiny",
        "adapter": "acme-support",
        "adapter_version": 1,
        "alias": None,
        "priority": "interactive",
        "output": None,
        "usage": {"prompt_tokens": 3, "completion_tokens": 0},
        "timings": {"queued_ms": None, "ttft_ms": None, "total_ms": None},
        "error": None,
    }


async def test_finished_job_reports_output_usage_and_timings(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]
    await finish_like_a_worker(fleet, job_id)

    body = await (await client.get(f"/v1/jobs/{job_id}", headers=fleet.auth("acme"))).json()

    assert body["status"] == "succeeded"
    assert body["output"] == {"text": " the lazy dog", "token_ids": [5, 11, 12], "finish_reason": "stop"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}
    timings = body["timings"]
    assert 0 <= timings["queued_ms"] <= timings["ttft_ms"] <= timings["total_ms"] < 10_000
    assert body["error"] is None


async def test_failed_job_reports_its_error(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]
    store = JobStore(fleet.redis, job_ttl_s=60)
    await store.start(job_id, "worker-1")
    await store.finish(job_id, JobStatus.FAILED, error=JobError("adapter_load_failed", "weights unreadable"))

    body = await (await client.get(f"/v1/jobs/{job_id}", headers=fleet.auth("acme"))).json()

    assert body["status"] == "failed"
    assert body["error"] == {"code": "adapter_load_failed", "message": "weights unreadable"}
    assert body["output"] is None
    assert body["timings"]["ttft_ms"] is None
    assert body["timings"]["total_ms"] is not None


async def test_long_poll_returns_as_soon_as_the_job_finishes(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]

    async def finish_soon() -> None:
        await asyncio.sleep(0.2)
        await finish_like_a_worker(fleet, job_id)

    started = time.monotonic()
    finisher = asyncio.create_task(finish_soon())
    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": "30"}, headers=fleet.auth("acme"))
    elapsed = time.monotonic() - started
    await finisher

    assert (await response.json())["status"] == "succeeded"
    assert 0.2 <= elapsed < LIMITS.max_wait_s * 0.8


async def test_long_poll_on_a_finished_job_returns_at_once(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]
    await finish_like_a_worker(fleet, job_id)

    started = time.monotonic()
    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": "30"}, headers=fleet.auth("acme"))

    assert (await response.json())["status"] == "succeeded"
    assert time.monotonic() - started < 0.5


async def test_long_poll_times_out_with_the_current_state(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]

    started = time.monotonic()
    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": "0.3"}, headers=fleet.auth("acme"))

    assert response.status == 200
    assert (await response.json())["status"] == "queued"
    assert 0.3 <= time.monotonic() - started < LIMITS.max_wait_s


async def test_wait_is_capped_at_max_wait(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet))["id"]

    started = time.monotonic()
    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": "3600"}, headers=fleet.auth("acme"))

    assert (await response.json())["status"] == "queued"
    assert LIMITS.max_wait_s <= time.monotonic() - started < LIMITS.max_wait_s + 1.0


@pytest.mark.parametrize("wait", ["soon", "-1", "nan", "inf", ""])
async def test_bad_wait_parameter_is_rejected(client: TestClient, fleet: Fleet, wait: str) -> None:
    job_id = (await submit(client, fleet))["id"]

    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": wait}, headers=fleet.auth("acme"))

    assert response.status == 400
    assert (await response.json())["error"]["param"] == "wait"


async def test_redis_read_timeout_outlasts_the_longest_long_poll(aiohttp_client: Any, redis_url: str) -> None:
    # redis-py's default 5 s socket timeout would abort every XREAD BLOCK longer than that
    config = GatewayConfig(redis_url=redis_url)  # default limits: long-polls of up to 60 s
    client = await aiohttp_client(create_app(config))

    assert client.app[REDIS].connection_pool.connection_kwargs["socket_timeout"] > config.limits.max_wait_s
