"""Files in Redis (the OpenAI Files API's storage): a hash of metadata and a list of lines per file,
so every gateway reads the same files and a gateway restart loses none (Redis persistence keeps
them across a Redis restart, as it keeps jobs). Sizes are bounded by BatchConfig (Redis holds files
in memory). A file is its tenant's alone: another tenant's file is reported like one that does not
exist. Expiry is kept in `lf:file-expiry` and applied by `remove_expired` on a schedule (and a file
past its expiry is already invisible), never by key TTLs, so the tenant's index is cleaned with it.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis

from gateway.errors import RequestError
from shared import keys
from shared.errors import ErrorCode

_FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
_PUSH_CHUNK = 1000  # lines per RPUSH: large files go in several commands of one transaction
_READ_CHUNK = 1000


class FilePurpose(StrEnum):
    BATCH = "batch"  # uploaded: a batch's input
    BATCH_OUTPUT = "batch_output"  # made by a batch: its output or error file


@dataclass(frozen=True, slots=True)
class FileRecord:
    file_id: str
    tenant: str
    filename: str
    purpose: FilePurpose
    num_bytes: int
    num_lines: int
    created_ms: int
    expires_ms: int

    def hset_mapping(self) -> dict[str, str | int]:
        return {
            "tenant": self.tenant,
            "filename": self.filename,
            "purpose": self.purpose.value,
            "bytes": self.num_bytes,
            "lines": self.num_lines,
            "created_ms": self.created_ms,
            "expires_ms": self.expires_ms,
        }

    @classmethod
    def from_hash(cls, file_id: str, raw: dict[bytes, bytes]) -> FileRecord:
        return cls(
            file_id=file_id,
            tenant=raw[b"tenant"].decode(),
            filename=raw[b"filename"].decode(),
            purpose=FilePurpose(raw[b"purpose"].decode()),
            num_bytes=int(raw[b"bytes"]),
            num_lines=int(raw[b"lines"]),
            created_ms=int(raw[b"created_ms"]),
            expires_ms=int(raw[b"expires_ms"]),
        )

    def openai_object(self) -> dict[str, Any]:
        """The OpenAI `file` object."""
        return {
            "id": self.file_id,
            "object": "file",
            "bytes": self.num_bytes,
            "created_at": self.created_ms // 1000,
            "expires_at": self.expires_ms // 1000,
            "filename": self.filename,
            "purpose": self.purpose.value,
            "status": "processed",
        }


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_not_found(file_id: str) -> RequestError:
    return RequestError(ErrorCode.FILE_NOT_FOUND, f"file {file_id!r:.80} not found", param="file_id")


def _now_ms() -> int:
    return int(time.time() * 1000)


class FileStore:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_ms = ttl_s * 1000

    async def create(self, tenant: str, filename: str, purpose: FilePurpose, lines: list[str]) -> FileRecord:
        """Store `lines` as a new file of `tenant`'s, all or nothing (one transaction)."""
        now = _now_ms()
        record = FileRecord(
            file_id=new_file_id(),
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            num_bytes=sum(len(line.encode()) + 1 for line in lines),
            num_lines=len(lines),
            created_ms=now,
            expires_ms=now + self._ttl_ms,
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            for start in range(0, len(lines), _PUSH_CHUNK):
                pipe.rpush(keys.file_lines(record.file_id), *lines[start : start + _PUSH_CHUNK])
            self.add_record(pipe, record)
            await pipe.execute()
        return record

    def add_record(self, pipe: Any, record: FileRecord) -> None:
        """Queue on `pipe` the commands that make `record` a file (its lines already in `lf:file-lines:{id}`)."""
        pipe.hset(keys.file(record.file_id), mapping=record.hset_mapping())
        pipe.zadd(keys.tenant_files(record.tenant), {record.file_id: record.created_ms})
        pipe.zadd(keys.FILE_EXPIRY, {record.file_id: record.expires_ms})

    async def get(self, tenant: str, file_id: str) -> FileRecord:
        """The tenant's file; FILE_NOT_FOUND for another tenant's, an expired one, or none."""
        raw = await self._redis.hgetall(keys.file(file_id)) if _FILE_ID.match(file_id) else {}
        record = FileRecord.from_hash(file_id, raw) if raw else None
        if record is None or record.tenant != tenant or record.expires_ms <= _now_ms():
            raise file_not_found(file_id)
        return record

    async def list(self, tenant: str) -> list[FileRecord]:
        """The tenant's files, newest first."""
        file_ids = [f.decode() for f in await self._redis.zrevrange(keys.tenant_files(tenant), 0, -1)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for file_id in file_ids:
                pipe.hgetall(keys.file(file_id))
            hashes = await pipe.execute()
        now = _now_ms()
        records = [FileRecord.from_hash(f, raw) for f, raw in zip(file_ids, hashes, strict=True) if raw]
        return [r for r in records if r.expires_ms > now]

    async def count_uploads(self, tenant: str) -> int:
        """The tenant's uploaded (purpose `batch`) files that have not expired."""
        return sum(1 for record in await self.list(tenant) if record.purpose is FilePurpose.BATCH)

    async def lines(self, file_id: str, start: int, count: int) -> list[str]:
        """Lines [start, start + count) of a file (fewer at its end)."""
        return [line.decode() for line in await self._redis.lrange(keys.file_lines(file_id), start, start + count - 1)]

    async def content(self, record: FileRecord) -> AsyncIterator[bytes]:
        """The file's bytes, a chunk of lines at a time, each line ending in a newline."""
        for start in range(0, record.num_lines, _READ_CHUNK):
            chunk = await self._redis.lrange(keys.file_lines(record.file_id), start, start + _READ_CHUNK - 1)
            yield b"".join(line + b"\n" for line in chunk)

    async def delete(self, record: FileRecord) -> None:
        await self._remove(record.file_id, record.tenant)

    async def remove_expired(self) -> int:
        """Remove every file past its expiry; returns how many."""
        expired = [f.decode() for f in await self._redis.zrangebyscore(keys.FILE_EXPIRY, "-inf", _now_ms())]
        for file_id in expired:
            tenant = await self._redis.hget(keys.file(file_id), "tenant")
            await self._remove(file_id, tenant.decode() if tenant else None)
        return len(expired)

    async def _remove(self, file_id: str, tenant: str | None) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.file(file_id), keys.file_lines(file_id))
            pipe.zrem(keys.FILE_EXPIRY, file_id)
            if tenant is not None:
                pipe.zrem(keys.tenant_files(tenant), file_id)
            await pipe.execute()
