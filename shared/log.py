"""structlog setup shared by every process: JSON lines, or a console renderer on a terminal.

`info_line` logs the one line a process writes so often that structlog's processor chain is a
measurable part of its cost (the gateway's access line, one per request: bench/gateway.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, BinaryIO

import orjson
import structlog
from structlog.typing import EventDict, WrappedLogger

# non-str keys become strings, as json.dumps made them; datetimes are written as TimeStamper(fmt="iso",
# utc=True) would, `2026-01-02T03:04:05.678901Z`, without formatting them in Python first
_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_UTC_Z


class LineSink:
    """Where a process's JSON lines go: a binary stream, written and flushed at once per line, or with
    `batched` once per event-loop turn for all the lines of that turn (a gateway writes a line per
    request, and a write system call per line was a measurable part of a request's CPU: bench/gateway.py).

    A batched line logged off any event loop (start-up, shutdown, another thread) is written at once,
    after the lines that wait; what waits at exit is written then. Lines keep their order within a thread.
    """

    def __init__(self, stream: BinaryIO, *, batched: bool) -> None:
        self._stream = stream
        self._batched = batched
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._flush_due_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
        if batched:
            atexit.register(self.flush)

    def msg(self, line: bytes) -> None:
        """Write `line` (without its newline), now or at the end of this event-loop turn."""
        loop = _running_loop() if self._batched else None
        with self._lock:
            self._pending.append(line)
            schedule = loop is not None and loop is not self._flush_due_on
            if schedule:
                self._flush_due_on = loop
        if loop is None:
            self.flush()
        elif schedule:
            loop.call_soon(self.flush)

    def flush(self) -> None:
        with self._lock:
            lines, self._pending, self._flush_due_on = self._pending, [], None
            if lines:
                lines.append(b"")  # each line ends with a newline
                self._stream.write(b"\n".join(lines))
                self._stream.flush()

    def __call__(self, *_name: Any) -> LineSink:
        """As structlog's logger factory: every logger writes to this one sink."""
        return self

    # structlog calls the method named like the level
    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _JsonInfoLines:
    """`info_line` for JSON lines at INFO: the line structlog would render, rendered here in one call."""

    def __init__(self, service: str, sink: LineSink) -> None:
        self._service = service
        self._sink = sink

    def write(self, event: str, fields: dict[str, Any]) -> None:
        fields["event"] = event
        fields["service"] = self._service
        fields["level"] = "info"
        fields["timestamp"] = datetime.now(UTC)
        self._sink.msg(orjson.dumps(fields, option=_ORJSON_OPTIONS))


_json_info_lines: _JsonInfoLines | None = None  # set by configure_logging when INFO lines are JSON
_log = structlog.get_logger(__name__)


def info_line(event: str, fields: dict[str, Any]) -> None:
    """Log `fields` (which this takes over) at INFO as `event`: the line `log.info(event, **fields)` would
    write, with the process's service and level and a timestamp, but without structlog's processor chain
    when lines are JSON. Context variables are not merged in: pass what the line needs (a request id)."""
    lines = _json_info_lines
    if lines is None:  # console lines, INFO filtered out, or logging not configured (tests)
        _log.info(event, **fields)
    else:
        lines.write(event, fields)


def configure_logging(
    service: str, *, level: str = "INFO", json_lines: bool | None = None, batched: bool = False
) -> None:
    """Route structlog and the stdlib loggers through one renderer, tagging every line with `service`.
    `batched`: JSON lines are written once per event-loop turn (LineSink), for a process whose event
    loop never blocks for long (the gateway): a line logged before a long blocking call would wait for it."""
    global _json_info_lines
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    min_level = logging.getLevelName(level.upper())
    _json_info_lines = None
    if json_lines:
        # orjson renders a line in a fraction of the standard library's time, timestamp included
        timestamper = _utc_now
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps, option=_ORJSON_OPTIONS)
        sink = LineSink(sys.stderr.buffer, batched=batched)
        logger_factory: Callable[..., WrappedLogger] = sink
        if min_level <= logging.INFO:
            _json_info_lines = _JsonInfoLines(service, sink)
    else:
        timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
        renderer = structlog.dev.ConsoleRenderer()
        logger_factory = structlog.PrintLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")


def _utc_now(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """The line's time as a datetime, which orjson writes (OPT_UTC_Z) exactly as TimeStamper(fmt="iso",
    utc=True) would, without formatting it in Python first."""
    event_dict["timestamp"] = datetime.now(UTC)
    return event_dict
