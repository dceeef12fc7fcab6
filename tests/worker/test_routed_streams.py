"""Worker streams (worker/routed_streams.py) on a real Redis: stealing only past the bound and only what
is undelivered, handing a stream over to the shared one, and adopting a dead worker's stream."""

from __future__ import annotations

import asyncio

from shared import keys
from worker.routed_streams import RoutedStreams

MODEL = "m"
BOUND_MS = 200


async def streams(aredis, *worker_ids: str) -> list[RoutedStreams]:
    views = [RoutedStreams(aredis, worker_id) for worker_id in worker_ids]
    for view in views:
        await view.register(MODEL)
    return views


async def test_an_entry_is_stolen_only_once_it_has_waited_past_the_bound(aredis):
    busy, idle = await streams(aredis, "busy", "idle")
    entry_id = await aredis.xadd(busy.own(MODEL), {"job": b"1"})

    assert await idle.steal(MODEL, 8, BOUND_MS) == []
    await asyncio.sleep(BOUND_MS / 1000 + 0.05)
    stolen = await idle.steal(MODEL, 8, BOUND_MS)

    assert stolen == [(busy.own(MODEL), [(entry_id, {b"job": b"1"})])]
    pending = await aredis.xpending_range(busy.own(MODEL), keys.WORKER_GROUP, min="-", max="+", count=10)
    assert [p["consumer"] for p in pending] == [b"idle"]  # acknowledged and renewed on the stream it came from


async def test_an_entry_its_worker_already_read_is_never_stolen(aredis):
    busy, idle = await streams(aredis, "busy", "idle")
    await aredis.xadd(busy.own(MODEL), {"job": b"1"})
    await aredis.xreadgroup(keys.WORKER_GROUP, "busy", {busy.own(MODEL): ">"})
    await asyncio.sleep(BOUND_MS / 1000 + 0.05)

    assert await idle.steal(MODEL, 8, BOUND_MS) == []


async def test_a_steal_takes_no_more_than_asked(aredis):
    busy, idle = await streams(aredis, "busy", "idle")
    for index in range(5):
        await aredis.xadd(busy.own(MODEL), {"job": str(index).encode()})
    await asyncio.sleep(BOUND_MS / 1000 + 0.05)

    [(_, entries)] = await idle.steal(MODEL, 2, BOUND_MS)

    assert [fields[b"job"] for _, fields in entries] == [b"0", b"1"]  # the oldest first


async def test_a_stopping_worker_hands_its_unread_entries_to_the_shared_stream(aredis):
    (leaving,) = await streams(aredis, "leaving")
    await aredis.xadd(leaving.own(MODEL), {"job": b"1"})
    await aredis.xadd(leaving.own(MODEL), {"job": b"2"})

    assert await leaving.hand_over_own(MODEL) == 2

    assert [f[b"job"] for _, f in await aredis.xrange(keys.queue(MODEL))] == [b"1", b"2"]
    assert not await aredis.exists(leaving.own(MODEL))
    assert not await aredis.sismember(keys.worker_queues(MODEL), leaving.own(MODEL))


async def test_a_dead_workers_stream_is_adopted_but_a_live_ones_is_not(aredis):
    dead, live, adopter = await streams(aredis, "dead", "live", "adopter")
    await aredis.hset(keys.worker("live"), "updated_ms", 1)  # a heartbeat: its worker is alive
    await aredis.xadd(dead.own(MODEL), {"job": b"dead-1"})
    await aredis.xadd(live.own(MODEL), {"job": b"live-1"})
    running = await aredis.xadd(dead.own(MODEL), {"job": b"dead-running"})
    await aredis.xadd(dead.own(MODEL), {"job": b"dead-2"})
    await aredis.xreadgroup(keys.WORKER_GROUP, "dead", {dead.own(MODEL): ">"}, count=2)  # was running 2

    moved = await adopter.adopt_orphans(MODEL)

    assert moved == 1  # the unread one; the two it read stay for XAUTOCLAIM to re-claim
    assert [f[b"job"] for _, f in await aredis.xrange(keys.queue(MODEL))] == [b"dead-2"]
    assert running in [entry_id for entry_id, _ in await aredis.xrange(dead.own(MODEL))]
    assert await aredis.xlen(live.own(MODEL)) == 1


async def test_a_stream_the_gateway_created_without_a_group_can_be_stolen_from(aredis):
    (idle,) = await streams(aredis, "idle")
    stream = keys.worker_queue(MODEL, "new")
    await aredis.xadd(stream, {"job": b"1"})  # the create script adds the entry and lists the stream
    await aredis.sadd(keys.worker_queues(MODEL), stream)
    await aredis.hset(keys.worker("new"), "updated_ms", 1)
    await asyncio.sleep(BOUND_MS / 1000 + 0.05)

    [(from_stream, entries)] = await idle.steal(MODEL, 8, BOUND_MS)

    assert from_stream == stream and len(entries) == 1


async def test_a_stream_handed_over_since_it_was_listed_is_not_brought_back_by_a_steal(aredis):
    leaving, idle = await streams(aredis, "leaving", "idle")
    await aredis.delete(leaving.own(MODEL))  # handed over and deleted, still listed as a reader last saw

    assert await idle.steal(MODEL, 8, BOUND_MS) == []
    assert not await aredis.exists(leaving.own(MODEL))


async def test_a_read_of_several_streams_takes_the_oldest_entries_over_all_of_them_and_no_more(aredis):
    (reader,) = await streams(aredis, "reader")
    shared = keys.queue(MODEL)
    for stream, entry_id in [(shared, "1000-0"), (reader.own(MODEL), "1500-0"), (shared, "2000-0"),
                             (reader.own(MODEL), "2500-0"), (shared, "3000-0")]:  # fmt: skip
        await aredis.xadd(stream, {"job": entry_id.encode()}, id=entry_id)

    first = await reader.read_oldest([shared, reader.own(MODEL)], 3)
    second = await reader.read_oldest([shared, reader.own(MODEL)], 3)

    assert {stream: [f[b"job"] for _, f in entries] for stream, entries in first} == {
        shared: [b"1000-0", b"2000-0"], reader.own(MODEL): [b"1500-0"]
    }  # fmt: skip
    assert {stream: [f[b"job"] for _, f in entries] for stream, entries in second} == {
        shared: [b"3000-0"], reader.own(MODEL): [b"2500-0"]
    }  # fmt: skip
    pending = await aredis.xpending(shared, keys.WORKER_GROUP)
    assert pending["pending"] == 3 and pending["consumers"] == [{"name": b"reader", "pending": 3}]
    assert await reader.read_oldest([shared, reader.own(MODEL)], 3) == []


async def test_a_read_skips_a_deleted_stream_and_reads_one_the_gateway_created_without_a_group(aredis):
    (reader,) = await streams(aredis, "reader")
    await aredis.delete(reader.own(MODEL))  # handed over meanwhile
    created = keys.worker_queue("other", "reader")
    await aredis.xadd(created, {"job": b"1"})  # routed here by its first entry: the stream has no group yet

    [(stream, entries)] = await reader.read_oldest([reader.own(MODEL), created], 8)

    assert stream == created and [f[b"job"] for _, f in entries] == [b"1"]
    assert not await aredis.exists(reader.own(MODEL))
