"""Webhook delivery: every gateway consumes `lf:webhooks` in one consumer group and POSTs each
finished job (the body `GET /v1/jobs/{id}` answers) to its URL, signed (webhook_signature.py).

The job store's terminal scripts queue an entry when a job with a webhook ends, so a delivery
exists once per job whoever ended it, and survives any gateway restart:
- a gateway reads new entries (XREADGROUP): each goes to one gateway, and stays pending until its
  call succeeds or is abandoned (then XACK + XDEL);
- a failed call leaves its entry pending; once it has been idle `retry_base_s` × 2^(calls - 1), any
  gateway takes it with XCLAIM, whose min-idle check is atomic and resets the idle time, so exactly
  one gateway makes each retry. A gateway that died mid-call leaves its entry pending, and another
  takes it after the same wait. `retry_base_s` > `timeout_s`, so a call in flight is never taken;
- a call is made again only if a gateway dies between the receiver's answer and its XACK: every call
  of one delivery carries the same `Lorafleet-Delivery` id, for receivers to dedupe on.
Redirects are not followed; a URL no longer on the allow-list when its turn comes is abandoned.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import structlog
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import RequestError
from gateway.metrics import GatewayMetrics
from gateway.views.jobs import job_body
from gateway.webhook_policy import check_webhook_url
from gateway.webhook_signature import DELIVERY_HEADER, SIGNATURE_HEADER, signature_header, tenant_signing_key
from shared import keys
from shared.config import WebhookConfig
from shared.jobstore import JobStore
from shared.tasks import TASK_STOP_S, cancel_and_wait

log = structlog.get_logger(__name__)

T = TypeVar("T")

ATTEMPT_HEADER = "Lorafleet-Attempt"
_MAX_BACKOFF_S = 3600.0
_READ_BLOCK_S = 1.0  # also how often the pending list is scanned for due retries
_SCAN_PAGE = 100
_REDIS_BACKOFF_S = (0.1, 2.0)


class WebhookDispatcher:
    def __init__(self, redis: Redis, store: JobStore, config: WebhookConfig, metrics: GatewayMetrics) -> None:
        assert config.enabled and config.secret is not None
        self._redis = redis
        self._store = store
        self._config = config
        self._secret = config.secret
        self._metrics = metrics
        self._consumer = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self._calls: set[asyncio.Task] = set()
        self._scan_from = "-"

    def backoff_s(self, calls: int) -> float:
        """How long an entry waits after its `calls`-th failed call."""
        return min(self._config.retry_base_s * 2 ** (calls - 1), _MAX_BACKOFF_S)

    async def run(self) -> None:
        """Deliver until cancelled; calls still in flight are cancelled too (their entries stay pending)."""
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers={"User-Agent": "lorafleet-webhooks"}) as session:
            try:
                delay = _REDIS_BACKOFF_S[0]
                while True:
                    try:
                        await self._once(session)
                        delay = _REDIS_BACKOFF_S[0]
                    except (RedisConnectionError, RedisTimeoutError) as exc:
                        log.warning("redis_unavailable", doing="webhooks", error=str(exc), retry_in_s=delay)
                        await asyncio.sleep(delay)
                        delay = min(2 * delay, _REDIS_BACKOFF_S[1])
            finally:
                await cancel_and_wait(self._calls, TASK_STOP_S)

    async def _once(self, session: aiohttp.ClientSession) -> None:
        room = self._config.max_concurrent - len(self._calls)
        if room <= 0:
            await asyncio.wait(self._calls, timeout=_READ_BLOCK_S, return_when=asyncio.FIRST_COMPLETED)
            return
        for entry_id, job_id, attempt in await self._claim_due(room):
            self._start(session, entry_id, job_id, attempt)
        room = self._config.max_concurrent - len(self._calls)
        if room <= 0:
            return
        try:
            response = await self._redis.xreadgroup(
                keys.WEBHOOK_GROUP, self._consumer, {keys.WEBHOOKS: ">"}, count=room, block=int(_READ_BLOCK_S * 1000)
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._ensure_group()
            return
        for _, entries in response or []:
            for entry_id, fields in entries:
                self._start(session, entry_id.decode(), fields[b"job"].decode(), 1)

    async def _ensure_group(self) -> None:
        try:  # from the stream's start: entries queued before any gateway ran are delivered too
            await self._redis.xgroup_create(keys.WEBHOOKS, keys.WEBHOOK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _claim_due(self, room: int) -> list[tuple[str, str, int]]:
        """Take up to `room` pending entries whose backoff has passed: (entry id, job id, this attempt's number).
        Scans the pending list a page at a time, resuming where the last scan stopped."""
        try:
            pending = await self._redis.xpending_range(
                keys.WEBHOOKS,
                keys.WEBHOOK_GROUP,
                min=self._scan_from,
                max="+",
                count=_SCAN_PAGE,
                idle=int(self._config.retry_base_s * 1000),
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._ensure_group()
            return []
        self._scan_from = "(" + pending[-1]["message_id"].decode() if len(pending) == _SCAN_PAGE else "-"
        claimed: list[tuple[str, str, int]] = []
        for item in pending:
            if len(claimed) >= room:
                break
            calls = item["times_delivered"]
            wait_ms = int(self.backoff_s(calls) * 1000)
            if item["time_since_delivered"] < wait_ms:
                continue
            entries = await self._redis.xclaim(
                keys.WEBHOOKS,
                keys.WEBHOOK_GROUP,
                self._consumer,
                min_idle_time=wait_ms,
                message_ids=[item["message_id"]],
            )
            for entry_id, fields in entries:
                if fields:  # an entry deleted meanwhile comes back without fields
                    claimed.append((entry_id.decode(), fields[b"job"].decode(), calls + 1))
        return claimed

    def _start(self, session: aiohttp.ClientSession, entry_id: str, job_id: str, attempt: int) -> None:
        task = asyncio.create_task(self._deliver(session, entry_id, job_id, attempt), name=f"webhook-{job_id}")
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _deliver(self, session: aiohttp.ClientSession, entry_id: str, job_id: str, attempt: int) -> None:
        record = await self._retrying(lambda: self._store.get(job_id))
        if record is None or record.webhook is None:
            await self._finish(entry_id, "expired", job_id=job_id)  # the record outlived its TTL: nothing to send
            return
        try:
            url = check_webhook_url(record.webhook, self._config)
        except RequestError as exc:
            await self._finish(entry_id, "abandoned", job_id=job_id, reason=exc.message)
            return
        body = json.dumps(job_body(record)).encode()
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: signature_header(tenant_signing_key(self._secret, record.tenant), int(time.time()), body),
            DELIVERY_HEADER: entry_id,
            ATTEMPT_HEADER: str(attempt),
        }
        try:
            async with session.post(url, data=body, headers=headers, allow_redirects=False) as response:
                status: int | str = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            status = type(exc).__name__
        if isinstance(status, int) and 200 <= status < 300:
            await self._finish(entry_id, "delivered", job_id=job_id, attempt=attempt)
        elif attempt >= self._config.max_attempts:
            await self._finish(entry_id, "abandoned", job_id=job_id, attempt=attempt, answer=status)
        else:
            self._metrics.webhook_calls.labels("failed").inc()
            log.warning(
                "webhook_failed", job_id=job_id, attempt=attempt, answer=status, retry_in_s=self.backoff_s(attempt)
            )

    async def _finish(self, entry_id: str, outcome: str, **details: object) -> None:
        """The delivery is over (sent, or never to be sent): acknowledge and delete its entry."""

        async def ack() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.xack(keys.WEBHOOKS, keys.WEBHOOK_GROUP, entry_id)
                pipe.xdel(keys.WEBHOOKS, entry_id)
                await pipe.execute()

        await self._retrying(ack)
        self._metrics.webhook_calls.labels(outcome).inc()
        (log.info if outcome == "delivered" else log.warning)(f"webhook_{outcome}", **details)

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt` until Redis answers (a delivery must not be lost to a Redis restart)."""
        delay = _REDIS_BACKOFF_S[0]
        while True:
            try:
                return await attempt()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("redis_unavailable", doing="webhook delivery", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _REDIS_BACKOFF_S[1])
