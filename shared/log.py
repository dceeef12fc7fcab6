"""structlog setup shared by every process: JSON lines, or a console renderer on a terminal."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime

import orjson
import structlog
from structlog.typing import EventDict, WrappedLogger


def configure_logging(service: str, *, level: str = "INFO", json_lines: bool | None = None) -> None:
    """Route structlog and the stdlib loggers through one renderer, tagging every line with `service`."""
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    if json_lines:
        # orjson renders a line in a fraction of the standard library's time (a gateway writes one per
        # request), timestamp included; non-str keys become strings, as json.dumps made them
        timestamper = _utc_now
        renderer = structlog.processors.JSONRenderer(
            serializer=orjson.dumps, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_UTC_Z
        )
        logger_factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
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
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")


def _utc_now(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """The line's time as a datetime, which orjson writes (OPT_UTC_Z) exactly as TimeStamper(fmt="iso",
    utc=True) would, `2026-01-02T03:04:05.678901Z`, without formatting it in Python first."""
    event_dict["timestamp"] = datetime.now(UTC)
    return event_dict
