"""Liveness and readiness probes (no authentication)."""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web
from redis.exceptions import RedisError

from gateway.json_response import json_response
from gateway.state import REDIS

READY_TIMEOUT_S = 2.0  # a Redis slower than this to answer PING counts as down

log = structlog.get_logger(__name__)


async def healthz(request: web.Request) -> web.Response:
    """200 while the process serves HTTP."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when Redis answers PING within READY_TIMEOUT_S, else 503: the gateway cannot queue or read jobs."""
    try:
        await asyncio.wait_for(request.app[REDIS].ping(), READY_TIMEOUT_S)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("not_ready", reason=repr(exc))
        return json_response({"status": "unavailable", "reason": "redis is not answering"}, status=503)
    return json_response({"status": "ready"})
