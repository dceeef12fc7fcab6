"""Typed keys for what the gateway keeps on its application and on each request (the Authenticator's
key is in gateway/auth.py, beside its class)."""

from __future__ import annotations

from aiohttp import web
from redis.asyncio import Redis

from gateway.batches import BatchStore
from gateway.files import FileStore
from gateway.job_service import JobService
from gateway.metrics import GatewayMetrics
from shared.config import GatewayConfig
from shared.schema import JobRecord

CONFIG = web.AppKey("config", GatewayConfig)
REDIS = web.AppKey("redis", Redis)
JOBS = web.AppKey("jobs", JobService)
METRICS = web.AppKey("metrics", GatewayMetrics)
FILES = web.AppKey("files", FileStore)
BATCHES = web.AppKey("batches", BatchStore)

REQUEST_ID = web.RequestKey("request_id", str)
QUEUED_JOB = web.RequestKey("queued_job", JobRecord)  # the job a request queued: its log line names it
