"""The adapter registry: `lf:adapters` (names) and `lf:adapter:{name}` (the current version's record).

An adapter name is global and owned by one tenant (or "shared", usable by all), and its files lie
under the owner's own directory of the adapter root (`<root>/<owner>/...`, shared/adapter_paths.py):
a path elsewhere is refused (ADAPTER_PATH_FORBIDDEN) before the filesystem is looked at. Registering an
existing name again creates a new version with new weights identity (`AdapterRef.uid`): jobs
already queued keep the version they were submitted with, and workers key every cached copy by
that identity, so a reload never serves the old weights under the new version or the reverse.

In flight: every job naming an adapter enters `lf:adapter-jobs:{name}` before it is queued
(`track_adapter_job`, atomically with a check that the adapter still exists). Unregistering sweeps
the jobs that have ended and refuses (CONFLICT, 409) while any is still queued or running, so an
adapter never disappears under a job that needs its files. Entries need no release step: ended
jobs are swept by their status, a few sampled at every submit and all at unregister.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from redis.asyncio import Redis

from shared import keys
from shared.adapter_format import read_adapter
from shared.adapter_paths import adapter_relative_path
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import ModelInfo
from shared.model_registry import AdapterLimits
from shared.schema import AdapterRef
from shared.tenants import SHARED_OWNER

# A tracked job whose record does not exist yet is being queued, not gone: the gateway tracks it
# just before it creates the record.
_QUEUEING_GRACE_MS = 60_000

_IN_FLIGHT = """
local function in_flight(job_key_prefix, id, tracked_ms, now_ms, grace_ms)
  local status = redis.call('HGET', job_key_prefix .. id, 'status')
  if status then return status == 'queued' or status == 'running' end
  return tonumber(tracked_ms) > tonumber(now_ms) - tonumber(grace_ms)
end
"""

_TRACK = (
    _IN_FLIGHT
    + """
-- KEYS: adapter record, its in-flight jobs   ARGV: job id, now_ms, job key prefix, grace_ms
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
local sample = redis.call('ZRANDMEMBER', KEYS[2], 4, 'WITHSCORES')
for i = 1, #sample, 2 do
  if not in_flight(ARGV[3], sample[i], sample[i + 1], ARGV[2], ARGV[4]) then
    redis.call('ZREM', KEYS[2], sample[i])
  end
end
return 1
"""
)

_UNREGISTER = (
    _IN_FLIGHT
    + """
-- KEYS: adapter record, adapter names, its in-flight jobs, the aliases naming it
-- ARGV: name, now_ms, job key prefix, grace_ms
if redis.call('SCARD', KEYS[4]) > 0 then return -1 end
local tracked = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
for i = 1, #tracked, 2 do
  if not in_flight(ARGV[3], tracked[i], tracked[i + 1], ARGV[2], ARGV[4]) then
    redis.call('ZREM', KEYS[3], tracked[i])
  end
end
local busy = redis.call('ZCARD', KEYS[3])
if busy > 0 then return busy end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('SREM', KEYS[2], ARGV[1])
return 0
"""
)

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
    digest: str  # of the weights file, with its scheme (shared/adapter_digest.py)
    created_ms: int
    slot_rank: int = 0  # the LoRA slot rank a worker needs: `rank`, or a fused expert gate_up LoRA's 2r

    def ref(self) -> AdapterRef:
        return AdapterRef(name=self.name, version=self.version, path=self.path, digest=self.digest)

    def visible_to(self, tenant_id: str) -> bool:
        return self.tenant in (tenant_id, SHARED_OWNER)

    def refusal(self, limits: AdapterLimits) -> str | None:
        """Why the workers with `limits` cannot serve this adapter, or None (model_registry.AdapterLimits)."""
        return limits.refusal(rank=self.slot_rank or self.rank, target_modules=self.target_modules)

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
    limits: AdapterLimits | None = None,
) -> AdapterRecord:
    """Validate the adapter at `path` (under `<adapter_root>/<tenant>/`) against `model` and, given
    them, the `limits` of the workers serving it (ADAPTER_EXCEEDS_MODEL_LIMITS), then record it as a
    new version of `name`. The files are read on a thread: up to `max_bytes` are hashed."""
    if not ADAPTER_NAME.match(name):
        raise LorafleetError(
            ErrorCode.INVALID_REQUEST, "adapter name must be 1-128 chars of letters, digits, '.', '_' or '-'"
        )
    relative = adapter_relative_path(adapter_root, path, owner=tenant)
    files = await asyncio.to_thread(read_adapter, adapter_root, relative, model, max_rank=max_rank, max_bytes=max_bytes)
    manifest = files.manifest
    if await redis.exists(keys.alias(name)):  # one namespace: a name in a request means one thing
        raise LorafleetError(ErrorCode.CONFLICT, f"{name!r} is an adapter alias's name")
    existing = await get_adapter(redis, name)
    if existing is not None and existing.tenant != tenant:
        raise LorafleetError(ErrorCode.CONFLICT, f"adapter name {name!r} belongs to another tenant")
    record = AdapterRecord(
        name=name,
        tenant=tenant,
        base_model=model.name,
        path=relative,
        version=1 if existing is None else existing.version + 1,
        rank=manifest.rank,
        lora_alpha=manifest.lora_alpha,
        use_rslora=manifest.use_rslora,
        target_modules=manifest.target_modules,
        size_bytes=manifest.size_bytes,
        digest=manifest.digest,
        created_ms=int(time.time() * 1000),
        slot_rank=manifest.serving_rank,
    )
    refusal = None if limits is None else record.refusal(limits)
    if refusal is not None:
        raise LorafleetError(ErrorCode.ADAPTER_EXCEEDS_MODEL_LIMITS, f"adapter {name!r} {refusal}")
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
    if "sha256" in data:  # registered before piece digests: a plain sha256, named as one (no worker verifies it)
        data["digest"] = f"sha256:{data.pop('sha256')}"
    return AdapterRecord(**data)


async def list_adapters(redis: Redis, *, visible_to: str | None = None) -> list[AdapterRecord]:
    """Every registered adapter, or only those tenant `visible_to` may use."""
    names = sorted(name.decode() for name in await redis.smembers(keys.ADAPTERS))
    records = [await get_adapter(redis, name) for name in names]
    return [r for r in records if r is not None and (visible_to is None or r.visible_to(visible_to))]


async def track_adapter_job(redis: Redis, name: str, job_id: str) -> bool:
    """Record job `job_id` as in flight on adapter `name`, just before the job is queued. False
    when the adapter has been unregistered meanwhile (the job must not be queued)."""
    script = redis.register_script(_TRACK)
    now_ms = int(time.time() * 1000)
    tracked = await script(
        keys=[keys.adapter(name), keys.adapter_jobs(name)], args=[job_id, now_ms, keys.job(""), _QUEUEING_GRACE_MS]
    )
    return bool(tracked)


async def unregister_adapter(redis: Redis, name: str, *, owner: str | None = None) -> AdapterRecord:
    """Remove adapter `name` (only if `owner` owns it, when given); new jobs naming it get
    ADAPTER_NOT_FOUND. Refused with CONFLICT while jobs naming it are queued or running, or an alias names
    it (shared/adapter_aliases.py): an alias never draws an adapter that is gone."""
    record = await get_adapter(redis, name)
    if record is None or (owner is not None and record.tenant != owner):
        raise LorafleetError(ErrorCode.ADAPTER_NOT_FOUND, f"adapter {name!r} not found")
    script = redis.register_script(_UNREGISTER)
    busy = await script(
        keys=[keys.adapter(name), keys.ADAPTERS, keys.adapter_jobs(name), keys.adapter_aliases(name)],
        args=[name, int(time.time() * 1000), keys.job(""), _QUEUEING_GRACE_MS],
    )
    if busy == -1:
        aliases = sorted(alias.decode() for alias in await redis.smembers(keys.adapter_aliases(name)))
        raise LorafleetError(
            ErrorCode.CONFLICT, f"adapter {name!r} is named by alias(es) {', '.join(aliases)}: take it out first"
        )
    if busy:
        raise LorafleetError(
            ErrorCode.CONFLICT, f"adapter {name!r} has {busy} job(s) queued or running: retry once they finish"
        )
    return record
