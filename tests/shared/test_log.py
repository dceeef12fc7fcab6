"""shared/log.py: JSON lines, the batched sink and the fast INFO line."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator

import orjson
import pytest
import structlog

import shared.log
from shared.log import LineSink, configure_logging, info_line


class CountedWrites(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


def test_an_unbatched_sink_writes_each_line_at_once() -> None:
    stream = CountedWrites()
    sink = LineSink(stream, batched=False)

    sink.info(b'{"a":1}')
    sink.error(b'{"b":2}')

    assert (stream.getvalue(), stream.writes) == (b'{"a":1}\n{"b":2}\n', 2)


async def test_a_batched_sink_writes_the_lines_of_a_loop_turn_together_in_order() -> None:
    stream = CountedWrites()
    sink = LineSink(stream, batched=True)

    for n in range(3):
        sink.info(b"%d" % n)
    assert stream.getvalue() == b""  # until the end of this turn
    await asyncio.sleep(0)
    sink.info(b"3")
    await asyncio.sleep(0)

    assert (stream.getvalue(), stream.writes) == (b"0\n1\n2\n3\n", 2)


async def test_a_batched_line_logged_off_the_loop_is_written_at_once_after_those_waiting() -> None:
    stream = CountedWrites()
    sink = LineSink(stream, batched=True)

    sink.info(b"on the loop")
    await asyncio.to_thread(sink.info, b"from a thread")

    assert stream.getvalue() == b"on the loop\nfrom a thread\n"


@pytest.fixture
def restored_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """configure_logging changes process-wide state: put it back for the tests that follow."""
    config = structlog.get_config()
    monkeypatch.setattr(shared.log, "_json_info_lines", None)
    monkeypatch.setattr(shared.log, "_log", structlog.get_logger())  # loggers keep the configuration they first used
    monkeypatch.setattr(shared.log.logging, "basicConfig", lambda **_: None)
    yield
    structlog.configure(**config)
    structlog.contextvars.unbind_contextvars("service")


@pytest.mark.usefixtures("restored_logging")
async def test_info_line_is_the_json_line_structlog_writes(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    configure_logging("gateway", json_lines=True, batched=True)
    fields = {"method": "POST", "status": 202, "request_id": "req-1", "adapter": None}

    info_line("request", dict(fields))
    structlog.get_logger().info("request", **fields)
    await asyncio.sleep(0)

    fast, slow = (orjson.loads(line) for line in capsysbinary.readouterr().err.splitlines())
    assert fast.pop("timestamp").endswith("Z")
    assert slow.pop("timestamp").endswith("Z")
    assert fast == slow == {**fields, "event": "request", "service": "gateway", "level": "info"}


@pytest.mark.usefixtures("restored_logging")
def test_info_line_is_filtered_by_the_level(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    configure_logging("gateway", level="WARNING", json_lines=True)

    info_line("request", {"status": 200})

    assert capsysbinary.readouterr().err == b""
