"""Prometheus scrape endpoint."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import METRICS, REDIS
from shared import keys
from shared.model_registry import list_models


async def metrics_view(request: web.Request) -> web.Response:
    """`GET /metrics` (no authentication, like the probes: expose it only where Prometheus scrapes)."""
    metrics = request.app[METRICS]
    redis = request.app[REDIS]
    models = [info.name for info in await list_models(redis)]
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.xlen(keys.queue(model))
        depths = await pipe.execute()
    for model, depth in zip(models, depths, strict=True):
        metrics.queue_depth.labels(model).set(depth)
    response = web.Response(body=generate_latest(metrics.registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response
