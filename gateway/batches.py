"""Batches in Redis (the OpenAI Batch API's records): `lf:batch:{id}` holds a batch's status, request
counts, the cursor of the next input line to queue and its file ids; `lf:batch-jobs:{id}` its lines
in flight (job id → its line index, custom_id and model); `lf:batch-out:{id}` and
`lf:batch-err:{id}` the output and error lines so far, which become its files when it finishes.
The driver (gateway/batch_driver.py) moves a batch along; this module only reads and writes its
records.

Statuses: validating → in_progress → finalizing → completed | expired (the window passed) |
cancelled (after cancelling); failed when the input cannot be run at all.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis

from gateway.errors import RequestError
from shared import keys
from shared.errors import ErrorCode

_BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")

# A status change only from the status the writer read: a cancel and the driver's next step can
# race, and neither may overwrite the other's newer status.
_SET_STATUS = """
-- KEYS: batch hash, active batches, batch expiry
-- ARGV: expected status, new status, stamps, expiry ms (0: not terminal), field/value...
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'stamps', ARGV[3], unpack(ARGV, 5))
if ARGV[4] ~= '0' then
  redis.call('SREM', KEYS[2], redis.call('HGET', KEYS[1], 'id'))
  redis.call('ZADD', KEYS[3], ARGV[4], redis.call('HGET', KEYS[1], 'id'))
end
return 1
"""


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


# the OpenAI batch object's timestamp field for each status it enters
_STAMP = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


@dataclass(slots=True)
class BatchRecord:
    batch_id: str
    tenant: str
    endpoint: str
    input_file_id: str
    created_ms: int
    expires_ms: int  # the end of the completion window
    status: BatchStatus = BatchStatus.VALIDATING
    final_status: BatchStatus | None = None  # while finalizing: the status it ends in
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    cursor: int = 0  # input lines before this index have been queued (or failed)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # why the batch as a whole failed
    stamps: dict[str, int] = field(default_factory=dict)  # status timestamps (unix s), by OpenAI field name

    def hset_mapping(self) -> dict[str, str | int]:
        mapping: dict[str, str | int] = {
            "id": self.batch_id,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "created_ms": self.created_ms,
            "expires_ms": self.expires_ms,
            "status": self.status.value,
            "metadata": json.dumps(self.metadata),
            "total": self.total,
            "completed": self.completed,
            "failed": self.failed,
            "cursor": self.cursor,
            "errors": json.dumps(self.errors),
            "stamps": json.dumps(self.stamps),
        }
        return mapping

    @classmethod
    def from_hash(cls, batch_id: str, raw: dict[bytes, bytes]) -> BatchRecord:
        def text(name: str) -> str | None:
            value = raw.get(name.encode())
            return None if value is None else value.decode()

        final = text("final_status")
        return cls(
            batch_id=batch_id,
            tenant=text("tenant") or "",
            endpoint=text("endpoint") or "",
            input_file_id=text("input_file_id") or "",
            created_ms=int(text("created_ms") or 0),
            expires_ms=int(text("expires_ms") or 0),
            status=BatchStatus(text("status")),
            final_status=BatchStatus(final) if final else None,
            metadata=json.loads(text("metadata") or "null"),
            total=int(text("total") or 0),
            completed=int(text("completed") or 0),
            failed=int(text("failed") or 0),
            cursor=int(text("cursor") or 0),
            output_file_id=text("output_file_id"),
            error_file_id=text("error_file_id"),
            errors=json.loads(text("errors") or "[]"),
            stamps=json.loads(text("stamps") or "{}"),
        )

    def openai_object(self) -> dict[str, Any]:
        """The OpenAI `batch` object."""
        return {
            "id": self.batch_id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": "24h",
            "status": self.status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_ms // 1000,
            "expires_at": self.expires_ms // 1000,
            **{name: self.stamps.get(name) for name in _STAMP.values()},
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def batch_not_found(batch_id: str) -> RequestError:
    return RequestError(ErrorCode.BATCH_NOT_FOUND, f"batch {batch_id!r:.80} not found", param="batch_id")


class BatchStore:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_ms = ttl_s * 1000
        self._set_status = redis.register_script(_SET_STATUS)

    async def create(self, record: BatchRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(record.batch_id), mapping=record.hset_mapping())
            pipe.zadd(keys.tenant_batches(record.tenant), {record.batch_id: record.created_ms})
            pipe.sadd(keys.BATCHES_ACTIVE, record.batch_id)
            await pipe.execute()

    async def active_using(self, file_id: str) -> str | None:
        """The id of an unfinished batch whose input is `file_id`, None if there is none."""
        batch_ids = [b.decode() for b in await self._redis.smembers(keys.BATCHES_ACTIVE)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hget(keys.batch(batch_id), "input_file_id")
            inputs = await pipe.execute()
        return next(
            (b for b, f in zip(batch_ids, inputs, strict=True) if f is not None and f.decode() == file_id), None
        )

    async def load(self, batch_id: str) -> BatchRecord | None:
        raw = await self._redis.hgetall(keys.batch(batch_id)) if _BATCH_ID.match(batch_id) else {}
        return BatchRecord.from_hash(batch_id, raw) if raw else None

    async def get(self, tenant: str, batch_id: str) -> BatchRecord:
        """The tenant's batch; BATCH_NOT_FOUND for another tenant's or none."""
        record = await self.load(batch_id)
        if record is None or record.tenant != tenant:
            raise batch_not_found(batch_id)
        return record

    async def list(self, tenant: str) -> list[BatchRecord]:
        """The tenant's batches, newest first."""
        batch_ids = [b.decode() for b in await self._redis.zrevrange(keys.tenant_batches(tenant), 0, -1)]
        records = [await self.load(batch_id) for batch_id in batch_ids]
        return [r for r in records if r is not None]

    async def set_status(self, record: BatchRecord, status: BatchStatus, *fields: str | int) -> bool:
        """Move the batch from the status `record` holds to `status` (stamping the time, writing the
        `field, value, ...` given); False, with nothing written, when its status changed meanwhile. A
        terminal status ends its driving and starts its retention."""
        stamps = {**record.stamps, _STAMP[status]: int(time.time())}
        expiry_ms = int(time.time() * 1000) + self._ttl_ms if status.is_terminal else 0
        changed = await self._set_status(
            keys=[keys.batch(record.batch_id), keys.BATCHES_ACTIVE, keys.BATCH_EXPIRY],
            args=[record.status.value, status.value, json.dumps(stamps), expiry_ms, *fields],
        )
        if changed:
            record.status, record.stamps = status, stamps
        return bool(changed)

    async def remove_expired(self) -> int:
        """Remove every finished batch past its retention, with its leftovers; returns how many."""
        now = int(time.time() * 1000)
        expired = [b.decode() for b in await self._redis.zrangebyscore(keys.BATCH_EXPIRY, "-inf", now)]
        for batch_id in expired:
            tenant = await self._redis.hget(keys.batch(batch_id), "tenant")
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(
                    keys.batch(batch_id), keys.batch_jobs(batch_id), keys.batch_output(batch_id),
                    keys.batch_errors(batch_id),
                )  # fmt: skip
                pipe.zrem(keys.BATCH_EXPIRY, batch_id)
                if tenant is not None:
                    pipe.zrem(keys.tenant_batches(tenant.decode()), batch_id)
                await pipe.execute()
        return len(expired)
