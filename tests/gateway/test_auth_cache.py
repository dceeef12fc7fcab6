"""A gateway remembers keys that authenticated for a few seconds, but never lets a rotated key or a
disabled tenant submit: the submit script checks both again, atomically with the admission."""

from __future__ import annotations

import asyncio
import time

from aiohttp.test_utils import TestClient

from gateway.ttl_cache import TtlCache
from shared import keys
from shared.tenants import rotate_key, set_disabled
from tests.gateway.fleet import Fleet, submit


async def test_a_key_rotated_elsewhere_cannot_submit_even_while_cached(client: TestClient, fleet: Fleet):
    await submit(client, fleet)  # the key is now cached by this gateway
    await rotate_key(fleet.redis, "acme")  # by another gateway, or the CLI
    response = await client.post("/v1/jobs", json={"model": "tiny", "prompt": "hello"}, headers=fleet.auth("acme"))
    assert response.status == 401 and (await response.json())["error"]["code"] == "invalid_api_key"
    assert await fleet.redis.xlen(keys.queue("tiny")) == 1  # the first job only


async def test_a_tenant_disabled_elsewhere_cannot_submit_even_while_cached(client: TestClient, fleet: Fleet):
    await submit(client, fleet)
    await set_disabled(fleet.redis, "acme", True)
    response = await client.post("/v1/jobs", json={"model": "tiny", "prompt": "hello"}, headers=fleet.auth("acme"))
    assert response.status == 403 and (await response.json())["error"]["code"] == "tenant_disabled"
    assert await fleet.redis.xlen(keys.queue("tiny")) == 1


def test_ttl_cache_entries_expire_and_the_oldest_goes_when_full(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cache: TtlCache[str, int] = TtlCache(ttl_s=5.0, max_entries=2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, 2, 3)
    now[0] += 5.5
    assert cache.get("b") is None and cache.get("c") is None


async def test_concurrent_misses_of_one_key_share_a_single_load():
    cache: TtlCache[str, int] = TtlCache(ttl_s=5.0, max_entries=8)
    loads = 0

    async def load() -> int:
        nonlocal loads
        loads += 1
        await asyncio.sleep(0.01)
        return 7

    assert await asyncio.gather(*(cache.get_or_load("k", load) for _ in range(50))) == [7] * 50
    assert loads == 1
    assert await cache.get_or_load("k", load) == 7 and loads == 1


async def test_a_failed_load_is_raised_to_every_waiter_and_not_remembered():
    cache: TtlCache[str, int] = TtlCache(ttl_s=5.0, max_entries=8)

    async def fail() -> int:
        await asyncio.sleep(0.01)
        raise KeyError("nope")

    results = await asyncio.gather(*(cache.get_or_load("k", fail) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(result, KeyError) for result in results)
    assert cache.get("k") is None
