"""structlog setup shared by every process: JSON lines, or a console renderer on a terminal."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog


def configure_logging(service: str, *, level: str = "INFO", json_lines: bool | None = None) -> None:
    """Route structlog and the stdlib loggers through one renderer, tagging every line with `service`."""
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    if json_lines:
        # orjson renders a line in a fraction of the standard library's time (a gateway writes one per
        # request); non-str keys become strings, as json.dumps made them
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps, option=orjson.OPT_NON_STR_KEYS)
        logger_factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
    else:
        renderer = structlog.dev.ConsoleRenderer()
        logger_factory = structlog.PrintLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
