"""Prometheus scrape endpoint."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import METRICS, REDIS
from shared.model_queues import model_queue_depth
from shared.model_registry import list_models
from shared.schema import PRIORITIES


async def metrics_view(request: web.Request) -> web.Response:
    """`GET /metrics` (no authentication, like the probes: expose it only where Prometheus scrapes)."""
    metrics = request.app[METRICS]
    redis = request.app[REDIS]
    models = [info.name for info in await list_models(redis)]
    now_ms = time.time() * 1000
    for model in models:
        for priority in PRIORITIES:
            depth, oldest_ms = await model_queue_depth(redis, model, priority)
            metrics.queue_depth.labels(model, priority.value).set(depth)
            # the oldest entry's wait, queued or running
            oldest_wait_ms = 0.0 if oldest_ms is None else max(0.0, now_ms - oldest_ms)
            metrics.queue_wait.labels(model, priority.value).set(oldest_wait_ms / 1000)
    response = web.Response(body=generate_latest(metrics.registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response
