"""Admission limits: per-tenant requests/min, tokens/min and concurrent jobs, and the per-model queue cap."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.app import create_app
from shared.config import GatewayConfig, TenantLimits
from shared.jobstore import JobStore
from shared.rate_limits import set_tenant_limits
from shared.schema import JobStatus
from tests.gateway.fleet import LIMITS


def _app(redis_url: str, **limits: int) -> Any:
    return create_app(GatewayConfig(redis_url=redis_url, limits=LIMITS, tenant_limits=TenantLimits(**limits)))


async def _post(client: TestClient, fleet, tenant: str = "acme", max_tokens: int = 4):
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": max_tokens}
    return await client.post("/v1/jobs", json=body, headers=fleet.auth(tenant))


async def _assert_429(response, limit_words: str, code: str = "rate_limit_exceeded") -> None:
    assert response.status == 429, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == code and limit_words in error["message"]
    assert int(response.headers["Retry-After"]) >= 1


@pytest.fixture
def limited(aiohttp_client: Any, redis_url: str, fleet):
    async def make(**limits: int) -> TestClient:
        return await aiohttp_client(_app(redis_url, **limits))

    return make


async def test_requests_per_minute_then_429_with_retry_after(limited, fleet):
    client = await limited(requests_per_min=3)
    for _ in range(3):
        assert (await _post(client, fleet)).status == 202
    await _assert_429(await _post(client, fleet), "requests per min")
    assert (await _post(client, fleet, tenant="globex")).status == 202  # per tenant


async def test_tokens_per_minute_counts_prompt_and_max_tokens(limited, fleet):
    client = await limited(tokens_per_min=20)
    assert (await _post(client, fleet, max_tokens=7)).status == 202  # 3 prompt + 7
    assert (await _post(client, fleet, max_tokens=7)).status == 202
    await _assert_429(await _post(client, fleet, max_tokens=7), "tokens per min")
    response = await _post(client, fleet, tenant="globex", max_tokens=30)  # can never fit in a minute
    assert response.status == 400 and (await response.json())["error"]["param"] == "max_tokens"


async def test_concurrent_jobs_free_up_when_jobs_finish(limited, fleet):
    client = await limited(max_concurrent_jobs=2)
    first = await (await _post(client, fleet)).json()
    assert (await _post(client, fleet)).status == 202
    await _assert_429(await _post(client, fleet), "concurrent jobs")
    await JobStore(fleet.redis, 60).cancel(first["id"])
    assert (await _post(client, fleet)).status == 202


async def test_a_tenants_own_limits_override_the_defaults(limited, fleet):
    client = await limited(requests_per_min=100)
    await set_tenant_limits(fleet.redis, "acme", {"requests_per_min": 1})
    assert (await _post(client, fleet)).status == 202
    await _assert_429(await _post(client, fleet), "requests per min")


async def test_model_queue_cap_is_queue_full(limited, fleet):
    client = await limited(max_queue_per_model=2)
    assert (await _post(client, fleet)).status == 202
    assert (await _post(client, fleet, tenant="globex")).status == 202
    await _assert_429(await _post(client, fleet), "queued or running", code="queue_full")


async def test_a_refused_request_does_not_spend_the_budget(limited, fleet):
    client = await limited(requests_per_min=1)
    bad = await client.post("/v1/jobs", json={"model": "missing", "prompt": "hi"}, headers=fleet.auth("acme"))
    assert bad.status == 404
    assert (await _post(client, fleet)).status == 202


async def test_finished_status_frees_a_slot(limited, fleet):
    client = await limited(max_concurrent_jobs=1)
    job = await (await _post(client, fleet)).json()
    await JobStore(fleet.redis, 60).finish(job["id"], JobStatus.FAILED)
    assert (await _post(client, fleet)).status == 202
