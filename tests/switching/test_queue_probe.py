"""Measuring a model's queue without consuming it, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from shared import keys
from shared.schema import Priority
from worker.switching.queue_probe import QueueProbe

STREAM = keys.queue("m")


def entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


async def probe(aredis: Redis, now_ms: int, claim_idle_ms: int = 60_000):
    return await QueueProbe(aredis, claim_idle_ms=claim_idle_ms).measure("m", now_ms=now_ms)


async def test_a_missing_stream_has_nothing_waiting(aredis: Redis) -> None:
    state = await probe(aredis, 1_000)
    assert (state.waiting, state.oldest_wait_s) == (0, 0.0)


async def test_without_a_group_every_entry_waits_since_the_first_was_added(aredis: Redis) -> None:
    first = await aredis.xadd(STREAM, {"job": b"1"})
    await aredis.xadd(STREAM, {"job": b"2"})
    state = await probe(aredis, entry_ms(first) + 1500)
    assert state.waiting == 2 and state.oldest_wait_s == pytest.approx(1.5)


async def test_entries_a_worker_read_do_not_wait_and_age_starts_at_the_first_unread(aredis: Redis) -> None:
    await aredis.xgroup_create(STREAM, keys.WORKER_GROUP, id="0", mkstream=True)
    await aredis.xadd(STREAM, {"job": b"1"})
    await aredis.xreadgroup(keys.WORKER_GROUP, "w1", {STREAM: ">"}, count=1)  # running on w1
    await asyncio.sleep(0.01)
    unread = await aredis.xadd(STREAM, {"job": b"2"})
    await aredis.xadd(STREAM, {"job": b"3"})
    state = await probe(aredis, entry_ms(unread) + 2000)
    assert state.waiting == 2 and state.oldest_wait_s == pytest.approx(2.0)


async def test_finished_entries_are_gone_and_nothing_waits(aredis: Redis) -> None:
    await aredis.xgroup_create(STREAM, keys.WORKER_GROUP, id="0", mkstream=True)
    entry = await aredis.xadd(STREAM, {"job": b"1"})
    await aredis.xreadgroup(keys.WORKER_GROUP, "w1", {STREAM: ">"}, count=1)
    await aredis.xack(STREAM, keys.WORKER_GROUP, entry)
    await aredis.xdel(STREAM, entry)
    state = await probe(aredis, entry_ms(entry) + 5000)
    assert (state.waiting, state.oldest_wait_s) == (0, 0.0)


async def test_a_dead_workers_pending_entries_count_as_waiting_once_idle_past_the_claim_time(aredis: Redis) -> None:
    await aredis.xgroup_create(STREAM, keys.WORKER_GROUP, id="0", mkstream=True)
    entry = await aredis.xadd(STREAM, {"job": b"1"})
    await aredis.xreadgroup(keys.WORKER_GROUP, "dead", {STREAM: ">"}, count=1)
    assert (await probe(aredis, entry_ms(entry) + 100, claim_idle_ms=50)).waiting == 0  # not idle yet
    await asyncio.sleep(0.08)
    state = await probe(aredis, entry_ms(entry) + 3000, claim_idle_ms=50)
    assert state.waiting == 1 and state.oldest_wait_s == pytest.approx(3.0)


async def test_jobs_routed_to_a_workers_stream_wait_beside_the_shared_streams(aredis: Redis) -> None:
    routed = keys.worker_queue("m", "w1")
    await aredis.sadd(keys.worker_queues("m"), routed)
    await aredis.xgroup_create(routed, keys.WORKER_GROUP, id="0", mkstream=True)
    await aredis.xadd(routed, {"job": b"1"})
    unread = await aredis.xadd(routed, {"job": b"2"})
    await aredis.xreadgroup(keys.WORKER_GROUP, "w1", {routed: ">"}, count=1)  # running on w1
    await asyncio.sleep(0.01)
    await aredis.xadd(STREAM, {"job": b"3"})
    await aredis.xadd(keys.queue("m", Priority.BATCH), {"job": b"4"})
    state = await probe(aredis, entry_ms(unread) + 4000)
    assert state.waiting == 3  # the routed one not read yet, the shared interactive one, the batch one
    assert state.oldest_wait_s == pytest.approx(4.0)  # the oldest waiting is the routed one


async def test_a_listed_stream_deleted_since_holds_nothing(aredis: Redis) -> None:
    # a dead worker's stream, handed over and deleted by another worker after this one listed it
    await aredis.sadd(keys.worker_queues("m"), keys.worker_queue("m", "gone"))
    entry = await aredis.xadd(STREAM, {"job": b"1"})
    state = await probe(aredis, entry_ms(entry) + 1000)
    assert state.waiting == 1 and state.oldest_wait_s == pytest.approx(1.0)
