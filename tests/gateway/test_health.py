"""Probes: /healthz while the process is up, /readyz only while Redis answers."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from cli.redis_server import free_port
from gateway.app import create_app
from shared.config import GatewayConfig


async def test_healthz_is_200(client: TestClient) -> None:
    response = await client.get("/healthz")

    assert response.status == 200
    assert await response.json() == {"status": "ok"}


async def test_readyz_is_200_when_redis_answers(client: TestClient) -> None:
    response = await client.get("/readyz")

    assert response.status == 200
    assert await response.json() == {"status": "ready"}


async def test_readyz_is_503_when_redis_is_down(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(GatewayConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0")))

    ready = await client.get("/readyz")
    alive = await client.get("/healthz")

    assert ready.status == 503
    assert (await ready.json())["status"] == "unavailable"
    assert alive.status == 200
