"""Prometheus scrape endpoint."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import METRICS, REDIS
from shared.model_queues import model_queue_length
from shared.model_registry import list_models


async def metrics_view(request: web.Request) -> web.Response:
    """`GET /metrics` (no authentication, like the probes: expose it only where Prometheus scrapes)."""
    metrics = request.app[METRICS]
    redis = request.app[REDIS]
    models = [info.name for info in await list_models(redis)]
    depths = [await model_queue_length(redis, model) for model in models]
    for model, depth in zip(models, depths, strict=True):
        metrics.queue_depth.labels(model).set(depth)
    response = web.Response(body=generate_latest(metrics.registry))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response
