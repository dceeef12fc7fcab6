"""The gateway's aiohttp application: `create_app(config)` wires state, middlewares and routes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from gateway.auth import AUTHENTICATOR, Authenticator
from gateway.auto_pipeline import AutoPipeline
from gateway.batch_driver import BatchDriver
from gateway.batches import BatchStore
from gateway.files import FileStore
from gateway.job_events import JobEventReader
from gateway.job_service import JobService
from gateway.metrics import GatewayMetrics
from gateway.middleware import request_middleware
from gateway.routes import setup_routes
from gateway.routing import FleetView
from gateway.state import BATCHES, CONFIG, FILES, JOBS, METRICS, REDIS
from gateway.tokenization import TokenizerCache
from gateway.webhooks import WebhookDispatcher
from shared.config import GatewayConfig
from shared.jobstore import JobStore
from shared.rate_limits import Admission
from shared.redis_client import resilient_redis
from shared.tasks import TASK_STOP_S, cancel_and_wait

# A long-poll holds a Redis XREAD BLOCK for up to limits.max_wait_s; the socket must outwait it by
# this much, or redis-py's default 5 s read timeout would cut every long-poll short.
_REDIS_READ_MARGIN_S = 5.0
_TOKENIZER_THREADS = min(4, os.cpu_count() or 1)
# an event stream with nothing to say sends a keep-alive this often (or every max_wait_s, if shorter:
# its blocking read must fit in the Redis socket timeout above)
_KEEPALIVE_S = 15.0


def create_app(config: GatewayConfig) -> web.Application:
    """The job API application. Redis and the tokenizer threads are opened on startup, closed on cleanup."""
    app = web.Application(
        middlewares=[request_middleware],
        client_max_size=config.limits.max_body_bytes,
    )
    app[CONFIG] = config
    app[METRICS] = GatewayMetrics()
    app[AUTHENTICATOR] = Authenticator()
    app.cleanup_ctx.append(_services)
    setup_routes(app)
    return app


async def _services(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    redis_timeout_s = config.limits.max_wait_s + _REDIS_READ_MARGIN_S
    redis = resilient_redis(config.redis_url, socket_timeout_s=redis_timeout_s)
    # the auto-pipeline's connections are its own: it times each batch itself, not each reply
    batched_redis = resilient_redis(config.redis_url, socket_timeout_s=None)
    executor = ThreadPoolExecutor(max_workers=_TOKENIZER_THREADS, thread_name_prefix="tokenize")
    app[REDIS] = redis
    batched = AutoPipeline(batched_redis, timeout_s=redis_timeout_s)
    store = JobStore(redis, config.job_ttl_s, batched=batched, replica_wait=config.replica_wait)
    events = JobEventReader(redis, block_ms=int(min(_KEEPALIVE_S, config.limits.max_wait_s) * 1000))
    events.start()
    app[JOBS] = JobService(
        redis,
        store,
        events,
        TokenizerCache(redis, executor),
        Admission(config.tenant_limits),
        events_idle_s=min(_KEEPALIVE_S, config.limits.max_wait_s),
        model_unserved_after_s=config.model_unserved_after_s,
        fleet=FleetView(redis, app[METRICS].jobs_placed, app[METRICS].jobs_placed_away)
        if config.adapter_routing
        else None,
        alias_jobs=app[METRICS].alias_jobs,
    )
    app[FILES] = FileStore(redis, config.batches.file_ttl_s)
    app[BATCHES] = BatchStore(redis, config.batches.batch_ttl_s)
    driver = BatchDriver(redis, app[BATCHES], app[FILES], app[JOBS], store, config.batches, config.limits)
    batch_driver = asyncio.create_task(driver.run())
    webhooks = None
    if config.webhooks.enabled:
        webhooks = asyncio.create_task(WebhookDispatcher(redis, store, config.webhooks, app[METRICS]).run())
    yield
    driver.stop()
    # the round under way ends by itself (its lease released) unless it is retrying a Redis that is
    # away, which takes ~9 s to give up: then it is cut off, and its batch's lease expires on its own
    _, retrying = await asyncio.wait({batch_driver}, timeout=TASK_STOP_S)
    await cancel_and_wait(retrying, TASK_STOP_S)
    if webhooks is not None:
        await cancel_and_wait([webhooks], TASK_STOP_S)
    await events.close()
    executor.shutdown(cancel_futures=True)
    await batched_redis.aclose()
    await redis.aclose()
