"""Auto-pipelining against a real Redis: concurrent commands share one pipeline, each caller gets its
own reply or its own error, a registered script runs through it (NOSCRIPT reloads it), and a batch
left unanswered past its timeout is sent again."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from gateway.auto_pipeline import AutoPipeline
from shared.redis_client import resilient_redis


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the client's sends (one per command or pipeline)."""
    count = [0]
    send = AbstractConnection.send_packed_command

    async def counted(self: AbstractConnection, command: object, check_health: bool = True) -> None:
        count[0] += 1
        await send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    return count


async def test_concurrent_commands_share_one_pipeline_and_get_their_own_replies(aredis, sends):
    for index in range(20):
        await aredis.hset(f"h{index}", mapping={"i": index})
    pipeline = AutoPipeline(aredis, timeout_s=5.0)
    before = sends[0]
    replies = await asyncio.gather(*(pipeline.hgetall(f"h{index}") for index in range(20)))
    assert replies == [{b"i": str(index).encode()} for index in range(20)]
    assert sends[0] - before == 1


async def test_an_error_goes_to_its_caller_alone(aredis):
    await aredis.set("a-string", "x")
    await aredis.hset("a-hash", "f", "v")
    pipeline = AutoPipeline(aredis, timeout_s=5.0)
    wrong, right = await asyncio.gather(
        pipeline.hgetall("a-string"), pipeline.hgetall("a-hash"), return_exceptions=True
    )
    assert isinstance(wrong, ResponseError) and "WRONGTYPE" in str(wrong)
    assert right == {b"f": b"v"}


async def test_a_script_runs_through_it_and_is_loaded_again_after_a_flush(aredis):
    script = aredis.register_script("return tonumber(ARGV[1]) + 1")
    pipeline = AutoPipeline(aredis, timeout_s=5.0)
    assert await asyncio.gather(*(script(args=[n], client=pipeline) for n in range(5))) == [1, 2, 3, 4, 5]
    await aredis.script_flush()  # as after a Redis restart
    assert await script(args=[41], client=pipeline) == 42


async def test_a_batch_not_answered_in_time_is_sent_again_and_answered(aredis, redis_url, sends):
    await aredis.hset("a-hash", "f", "v")
    client = resilient_redis(redis_url, socket_timeout_s=None)  # as the gateway's: retries with backoff
    pipeline = AutoPipeline(client, timeout_s=0.2)
    await aredis.client_pause(600)  # milliseconds in which Redis answers no client
    before = sends[0]
    assert await pipeline.hgetall("a-hash") == {b"f": b"v"}  # the reply to this command, not a stale one
    assert sends[0] - before >= 2
    await client.aclose()
