"""How the worker's loops live through losing Redis: an attempt that fails on the connection is
logged, waited out with exponential backoff and tried again; any other error is the caller's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = structlog.get_logger(__name__)

T = TypeVar("T")

_BACKOFF_MIN_S = 0.1  # a loop that lost Redis waits this long, doubling up to the max, between tries
_BACKOFF_MAX_S = 2.0


async def retrying(what: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run `attempt` until it gets through: a lost Redis connection is logged, waited out and retried."""
    delay = _BACKOFF_MIN_S
    while True:
        try:
            return await attempt()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("redis_unavailable", doing=what, error=str(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, _BACKOFF_MAX_S)
