"""Prometheus scrape endpoint."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import METRICS, REDIS
from shared import keys
from shared.model_registry import list_models
from shared.schema import PRIORITIES


async def metrics_view(request: web.Request) -> web.Response:
    """`GET /metrics` (no authentication, like the probes: expose it only where Prometheus scrapes)."""
    metrics = request.app[METRICS]
    redis = request.app[REDIS]
    models = [info.name for info in await list_models(redis)]
    queues = [(model, priority) for model in models for priority in PRIORITIES]
    async with redis.pipeline(transaction=False) as pipe:
        for model, priority in queues:
            pipe.xlen(keys.queue(model, priority))
            pipe.xrange(keys.queue(model, priority), count=1)
        replies = await pipe.execute()
    now_ms = time.time() * 1000
    for (model, priority), depth, oldest in zip(queues, replies[::2], replies[1::2], strict=True):
        metrics.queue_depth.labels(model, priority.value).set(depth)
        # a stream id starts with the unix ms it was added at: the oldest entry's wait, queued or running
        oldest_ms = int(oldest[0][0].split(b"-")[0]) if oldest else now_ms
        metrics.queue_wait.labels(model, priority.value).set(max(0.0, now_ms - oldest_ms) / 1000)
    response = web.Response(body=generate_latest(metrics.registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response
