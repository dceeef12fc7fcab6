"""The adapter registry: `lf:adapters` (names) and `lf:adapter:{name}` (the current version's record).

An adapter name is global and owned by one tenant (or "shared", usable by all). Registering an
existing name again creates a new version with new weights identity (`AdapterRef.uid`): jobs
already queued keep the version they were submitted with.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from redis.asyncio import Redis

from shared import keys
from shared.adapter_format import inspect_adapter, resolve_adapter_dir
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import ModelInfo
from shared.schema import AdapterRef

SHARED_OWNER = "shared"
# no ':' — `BASE:ADAPTER` is how OpenAI-style clients name a base model plus an adapter
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    name: str
    tenant: str  # owning tenant, or "shared"
    base_model: str
    path: str  # relative to the adapter root
    version: int
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    size_bytes: int
    sha256: str
    created_ms: int

    def ref(self) -> AdapterRef:
        return AdapterRef(name=self.name, version=self.version, path=self.path, sha256=self.sha256)

    def visible_to(self, tenant_id: str) -> bool:
        return self.tenant in (tenant_id, SHARED_OWNER)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        return data


async def register_adapter(
    redis: Redis,
    *,
    name: str,
    tenant: str,
    model: ModelInfo,
    adapter_root: Path,
    path: str,
    max_rank: int,
    max_bytes: int,
) -> AdapterRecord:
    """Validate the adapter at `path` against `model`, then record it as a new version of `name`."""
    if not ADAPTER_NAME.match(name):
        raise LorafleetError(
            ErrorCode.INVALID_REQUEST, "adapter name must be 1-128 chars of letters, digits, '.', '_' or '-'"
        )
    adapter_dir = resolve_adapter_dir(adapter_root, path)
    manifest = inspect_adapter(adapter_dir, model, max_rank=max_rank, max_bytes=max_bytes)
    existing = await get_adapter(redis, name)
    if existing is not None and existing.tenant != tenant:
        raise LorafleetError(ErrorCode.CONFLICT, f"adapter name {name!r} belongs to another tenant")
    record = AdapterRecord(
        name=name,
        tenant=tenant,
        base_model=model.name,
        path=str(adapter_dir.relative_to(Path(adapter_root).resolve())),
        version=1 if existing is None else existing.version + 1,
        rank=manifest.rank,
        lora_alpha=manifest.lora_alpha,
        use_rslora=manifest.use_rslora,
        target_modules=manifest.target_modules,
        size_bytes=manifest.size_bytes,
        sha256=manifest.sha256,
        created_ms=int(time.time() * 1000),
    )
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.adapter(name), mapping={"record": json.dumps(record.to_dict()), "tenant": tenant})
        pipe.sadd(keys.ADAPTERS, name)
        await pipe.execute()
    return record


async def get_adapter(redis: Redis, name: str) -> AdapterRecord | None:
    raw = await redis.hget(keys.adapter(name), "record")
    if raw is None:
        return None
    data = json.loads(raw)
    data["target_modules"] = tuple(data["target_modules"])
    return AdapterRecord(**data)


async def list_adapters(redis: Redis, *, visible_to: str | None = None) -> list[AdapterRecord]:
    """Every registered adapter, or only those tenant `visible_to` may use."""
    names = sorted(name.decode() for name in await redis.smembers(keys.ADAPTERS))
    records = [await get_adapter(redis, name) for name in names]
    return [r for r in records if r is not None and (visible_to is None or r.visible_to(visible_to))]


async def unregister_adapter(redis: Redis, name: str, *, owner: str | None = None) -> AdapterRecord:
    """Remove adapter `name` (only if `owner` owns it, when given). Jobs already queued keep the
    version they were submitted with; new jobs naming it get ADAPTER_NOT_FOUND."""
    record = await get_adapter(redis, name)
    if record is None or (owner is not None and record.tenant != owner):
        raise LorafleetError(ErrorCode.ADAPTER_NOT_FOUND, f"adapter {name!r} not found")
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.adapter(name))
        pipe.srem(keys.ADAPTERS, name)
        await pipe.execute()
    return record
