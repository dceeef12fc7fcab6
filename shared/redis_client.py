"""The one way long-running processes (gateway, worker) open Redis: a client that rides out a restart.

Every command is retried on a connection error or timeout with exponential backoff and jitter, so a
Redis restart of a few seconds shows up as latency, not as errors. Past the retries the error
reaches the caller, whose loops log it, back off and carry on.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError

# 0.05 s doubling to 2 s: 10 retries span about 10 s, longer than a Redis restart with a small AOF
RETRIES = 10
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
CONNECT_TIMEOUT_S = 5.0


def resilient_redis(url: str, *, socket_timeout_s: float | None) -> Redis:
    """A client for `url` whose commands retry through a restart. `socket_timeout_s` must outlast the
    longest blocking command the caller issues (XREAD/XREADGROUP BLOCK); None: no socket timeout, for a
    caller that times its commands itself (gateway/auto_pipeline.py)."""
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
    )
