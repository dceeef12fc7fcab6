"""1,200 generated malformed requests across every route the gateway serves get no 5xx, and the
gateway still accepts a valid job afterwards: in-process for speed, then a sample against a real
gateway process."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from gateway.app import create_app
from shared.adapter_registry import SHARED_OWNER
from shared.config import GatewayConfig
from shared.model_registry import publish_model
from shared.schema import JobStatus
from shared.tenants import create_tenant
from tests.fleet import Fleet as ProcessFleet
from tests.gateway.fleet import LIMITS, Fleet, build_tokenizer, submit, tiny_model
from tests.reliability.malformed import Corpus, Malformed

REQUESTS = 1200
PROCESS_SAMPLE = 200
CONCURRENCY = 32


def route_table(app: web.Application) -> list[tuple[str, str]]:
    """(method, path template) of every route, HEAD included."""
    return [(route.method, route.resource.canonical) for route in app.router.routes() if route.resource is not None]


async def send_all(session: Any, requests: list[Malformed]) -> Counter[int]:
    """Send every request (CONCURRENCY at a time); returns the count of each status."""
    statuses: Counter[int] = Counter()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def send(request: Malformed) -> None:
        async with gate:
            try:
                response = await asyncio.wait_for(
                    session.request(request.method, request.path, headers=request.headers, data=request.body), 15
                )
            except aiohttp.ClientResponseError as exc:  # e.g. the server's 400 for an 8 KiB header line,
                statuses[exc.status] += 1  # which the client then fails to parse
                return
            statuses[response.status] += 1
            if response.status >= 500:
                print(f"{response.status} for {request.method} {request.path[:200]}: {await response.text()}")
            response.close()  # an event stream stays open otherwise

    await asyncio.gather(*(send(request) for request in requests))
    return statuses


@pytest.fixture
async def gateway_fleet(aredis: Redis, tmp_path: Path) -> Fleet:
    """Tenants acme and globex, model tiny, adapters acme-support and shared-chat."""
    tokenizer = build_tokenizer()
    fleet = Fleet(aredis, tmp_path / "adapters", {}, {}, {}, tokenizer)
    fleet.models["tiny"] = tiny_model("tiny")
    await publish_model(aredis, fleet.models["tiny"], tokenizer.to_str().encode())
    for tenant in ("acme", "globex"):
        fleet.api_keys[tenant] = await create_tenant(aredis, tenant)
    await fleet.add_adapter("acme-support", "acme", "tiny")
    await fleet.add_adapter("shared-chat", SHARED_OWNER, "tiny")
    return fleet


async def test_malformed_requests_never_get_a_5xx_and_the_gateway_keeps_serving(
    aiohttp_client: Any, redis_url: str, gateway_fleet: Fleet
):
    app = create_app(GatewayConfig(redis_url=redis_url, limits=LIMITS))
    client: TestClient = await aiohttp_client(app)
    own_job = (await submit(client, gateway_fleet))["id"]
    corpus = Corpus(seed=8, routes=route_table(app), api_key=gateway_fleet.api_keys["acme"], job_ids=[own_job])

    statuses = await send_all(client, corpus.requests(REQUESTS))

    assert sum(statuses.values()) == REQUESTS
    assert not [status for status in statuses if status >= 500], statuses
    assert len([status for status in statuses if 400 <= status < 500]) >= 5  # varied rejections, not one path
    assert (await submit(client, gateway_fleet, prompt="the quick brown fox"))["status"] == "queued"


@pytest.mark.slow
def test_a_real_gateway_process_survives_malformed_requests(fleet: ProcessFleet):
    fleet.start_gateway()
    routes = [("POST", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}"), ("POST", "/v1/jobs/{job_id}/cancel")]
    api_key = next(iter(fleet.api_keys.values()))
    corpus = Corpus(seed=9, routes=routes, api_key=api_key, job_ids=[])

    async def scenario() -> Counter[int]:
        async with aiohttp.ClientSession(base_url=fleet.url) as session:
            return await send_all(session, corpus.requests(PROCESS_SAMPLE))

    statuses = asyncio.run(scenario())
    assert not [status for status in statuses if status >= 500], statuses
    fleet.start_worker("w1")
    job_ids = fleet.submit([{"model": "demo", "prompt": "still serving", "max_tokens": 4}])
    assert fleet.wait_finished(job_ids, timeout_s=30)[0].status is JobStatus.SUCCEEDED
