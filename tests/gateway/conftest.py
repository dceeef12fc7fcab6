"""A small fleet in the test Redis (two tenants, two models, four adapters) and a gateway client on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from gateway.app import create_app
from shared.adapter_registry import SHARED_OWNER
from shared.config import GatewayConfig
from shared.model_registry import publish_model
from shared.tenants import create_tenant, hash_admin_key
from tests.gateway.fleet import ADMIN_KEY, LIMITS, Fleet, build_tokenizer, tiny_model


@pytest.fixture
async def fleet(aredis: Redis, tmp_path: Path) -> Fleet:
    """Tenants acme and globex; models tiny and other; adapters acme-support (acme, tiny),
    globex-legal (globex, tiny), shared-chat (shared, tiny) and acme-other (acme, other)."""
    tokenizer = build_tokenizer()
    fleet = Fleet(aredis, tmp_path / "adapters", {}, {}, {}, tokenizer)
    for name in ("tiny", "other"):
        fleet.models[name] = tiny_model(name)
        await publish_model(aredis, fleet.models[name], tokenizer.to_str().encode())
    for tenant in ("acme", "globex"):
        fleet.api_keys[tenant] = await create_tenant(aredis, tenant)
    await fleet.add_adapter("acme-support", "acme", "tiny")
    await fleet.add_adapter("globex-legal", "globex", "tiny")
    await fleet.add_adapter("shared-chat", SHARED_OWNER, "tiny")
    await fleet.add_adapter("acme-other", "acme", "other")
    return fleet


@pytest.fixture
def gateway_config(redis_url: str) -> GatewayConfig:
    return GatewayConfig(redis_url=redis_url, limits=LIMITS)


@pytest.fixture
async def client(aiohttp_client: Any, gateway_config: GatewayConfig, fleet: Fleet) -> TestClient:
    return await aiohttp_client(create_app(gateway_config))


@pytest.fixture
async def admin_client(aiohttp_client: Any, redis_url: str, fleet: Fleet) -> TestClient:
    """A gateway with the admin API on (key ADMIN_KEY) and the fleet's adapter root."""
    config = GatewayConfig(
        redis_url=redis_url,
        limits=LIMITS,
        admin_key_sha256=hash_admin_key(ADMIN_KEY),
        adapter_root=fleet.adapter_root,
        max_lora_rank=8,
    )
    return await aiohttp_client(create_app(config))
