"""The gateway's job event reader against a real Redis: one blocking read for every waiting client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.job_events import JobEventReader
from shared import keys


@pytest.fixture
async def reader(redis_url: str) -> AsyncIterator[JobEventReader]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=10)
    reader = JobEventReader(client, block_ms=2_000)
    reader.start()
    yield reader
    await reader.close()
    await client.aclose()


async def _event(aredis: aioredis.Redis, job_id: str, kind: str = "token") -> bytes:
    return await aredis.xadd(keys.job_events(job_id), {"type": kind})


async def test_a_subscriber_gets_what_is_written_after_it_subscribed_and_nothing_before_its_position(
    reader: JobEventReader, aredis: aioredis.Redis
) -> None:
    seen = await _event(aredis, "j1")
    async with reader.subscribe("j1", after=seen.decode()) as events:
        asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(_event(aredis, "j1", "end")))
        entries = await events.next(5.0)
    assert [fields[b"type"] for _, fields in entries] == [b"end"]


async def test_next_returns_nothing_when_no_event_comes_in_time(reader: JobEventReader) -> None:
    async with reader.subscribe("quiet") as events:
        assert await events.next(0.3) == []


async def test_a_late_subscriber_from_the_start_gets_the_entries_an_earlier_one_had_passed(
    reader: JobEventReader, aredis: aioredis.Redis
) -> None:
    """The read in flight is positioned past the early entries: the new subscription restarts it."""
    first_id = await _event(aredis, "j2")
    async with reader.subscribe("j2", after=first_id.decode()) as ahead:
        await asyncio.sleep(0.1)  # the reader now blocks on j2 past the first entry
        async with reader.subscribe("j2") as from_start:
            entries = await from_start.next(5.0)
            assert [entry_id for entry_id, _ in entries] == [first_id]
        await _event(aredis, "j2", "end")
        assert [fields[b"type"] for _, fields in await ahead.next(5.0)] == [b"end"]


async def test_hundreds_of_waiting_clients_share_one_blocking_connection(
    reader: JobEventReader, aredis: aioredis.Redis
) -> None:
    """Past redis-py's default pool cap of 100 connections, which a connection per waiter exhausted."""
    waiters = 300

    async def wait_for_end(job_id: str) -> bytes:
        async with reader.subscribe(job_id) as events:
            while True:
                for _, fields in await events.next(10.0):
                    if fields[b"type"] == b"end":
                        return fields[b"type"]

    before = len(await aredis.client_list())
    tasks = [asyncio.create_task(wait_for_end(f"many-{i}")) for i in range(waiters)]
    await asyncio.sleep(0.5)
    assert len(await aredis.client_list()) - before <= 3  # the server's count of connections
    for i in range(waiters):
        await _event(aredis, f"many-{i}", "end")
    assert await asyncio.wait_for(asyncio.gather(*tasks), 20) == [b"end"] * waiters
