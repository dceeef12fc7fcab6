"""A known model that no live worker serves is refused with 503 model_unavailable, not queued to wait
forever; an unknown one stays a 404. Workers advertise their models on publishing and every heartbeat."""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from shared import keys
from shared.config import GatewayConfig
from shared.model_registry import SERVED_MS, mark_served
from tests.gateway.fleet import LIMITS, Fleet, submit

UNSERVED_AFTER_S = 30.0


@pytest.fixture
def gateway_config(redis_url: str) -> GatewayConfig:
    return GatewayConfig(redis_url=redis_url, limits=LIMITS, model_unserved_after_s=UNSERVED_AFTER_S)


async def post(client: TestClient, fleet: Fleet, model: str) -> tuple[int, dict[str, Any]]:
    response = await client.post("/v1/jobs", json={"model": model, "prompt": "hello"}, headers=fleet.auth("acme"))
    return response.status, await response.json()


async def served_ago(aredis: Redis, model: str, seconds: float) -> None:
    async with aredis.pipeline(transaction=False) as pipe:
        mark_served(pipe, model, int((time.time() - seconds) * 1000))
        await pipe.execute()


async def test_a_model_published_by_a_worker_just_now_is_served(client: TestClient, fleet: Fleet) -> None:
    assert (await submit(client, fleet))["status"] == "queued"


async def test_a_model_no_worker_advertised_for_a_while_is_503_and_nothing_is_queued(
    client: TestClient, fleet: Fleet, aredis: Redis
) -> None:
    await served_ago(aredis, "tiny", UNSERVED_AFTER_S + 5)
    status, body = await post(client, fleet, "tiny")
    assert status == 503
    assert body["error"]["code"] == "model_unavailable" and body["error"]["param"] == "model"
    assert await aredis.xlen(keys.queue("tiny")) == 0


async def test_a_model_never_advertised_by_a_worker_is_503(client: TestClient, fleet: Fleet, aredis: Redis) -> None:
    await aredis.hdel(keys.model("other"), SERVED_MS)
    status, body = await post(client, fleet, "other")
    assert (status, body["error"]["code"]) == (503, "model_unavailable")


async def test_a_heartbeat_makes_the_model_available_again(client: TestClient, fleet: Fleet, aredis: Redis) -> None:
    await served_ago(aredis, "tiny", UNSERVED_AFTER_S + 5)
    assert (await post(client, fleet, "tiny"))[0] == 503
    await served_ago(aredis, "tiny", 1)
    assert (await submit(client, fleet))["status"] == "queued"


async def test_an_unknown_model_is_still_404(client: TestClient, fleet: Fleet) -> None:
    status, body = await post(client, fleet, "gpt-9")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
