"""Admin commands over the fleet's Redis: `lorafleet tenant create`, `lorafleet adapter register` and
`lorafleet alias set / list / delete`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from redis.asyncio import Redis

from shared import keys
from shared.adapter_aliases import AdapterAlias, AliasVersion, delete_alias, list_aliases, set_alias
from shared.adapter_registry import SHARED_OWNER, AdapterRecord, register_adapter
from shared.config import EngineConfig
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import ModelInfo
from shared.model_registry import get_model
from shared.redis_client import plain_redis
from shared.tenants import create_tenant

T = TypeVar("T")


def tenant_create(redis_url: str, name: str, *, as_json: bool) -> int:
    api_key = asyncio.run(_create_tenant(redis_url, name))
    if as_json:
        print(json.dumps({"tenant": name, "api_key": api_key}))
    else:
        print(f"created tenant {name}\napi key (shown only now, keep it safe): {api_key}")
    return 0


async def _create_tenant(redis_url: str, name: str) -> str:
    async with plain_redis(redis_url) as redis:
        return await create_tenant(redis, name)


@dataclass(frozen=True, slots=True)
class AdapterRegistration:
    name: str
    tenant: str  # owner, or "shared"
    model: str
    path: str  # relative to adapter_root, or absolute inside it
    adapter_root: Path
    model_path: Path | None  # read the model's config here when no worker has published it
    max_rank: int


def adapter_register(redis_url: str, registration: AdapterRegistration, *, as_json: bool) -> int:
    record = asyncio.run(_register(redis_url, registration))
    if as_json:
        print(json.dumps(record.to_dict()))
    else:
        print(
            f"registered adapter {record.name} version {record.version} for tenant {record.tenant} on model "
            f"{record.base_model}: rank {record.rank}, targets {', '.join(record.target_modules)}, path {record.path}"
        )
    return 0


async def _model_info(redis: Redis, model: str, model_path: Path | None) -> ModelInfo:
    """The model as its workers published it, else as its config.json at `model_path` describes it."""
    info = await get_model(redis, model)
    if info is not None:
        return info
    if model_path is None:
        raise LorafleetError(
            ErrorCode.MODEL_NOT_FOUND,
            f"no worker has published model {model!r}; start one, or pass --model-path to read its config",
        )
    return ModelInfo.from_pretrained(model, model_path)


async def _register(redis_url: str, registration: AdapterRegistration) -> AdapterRecord:
    async with plain_redis(redis_url) as redis:
        tenant = registration.tenant
        if tenant != SHARED_OWNER and not await redis.sismember(keys.TENANTS, tenant):
            raise LorafleetError(
                ErrorCode.NOT_FOUND, f"tenant {tenant!r} does not exist (create it with `lorafleet tenant create`)"
            )
        return await register_adapter(
            redis,
            name=registration.name,
            tenant=tenant,
            model=await _model_info(redis, registration.model, registration.model_path),
            adapter_root=registration.adapter_root,
            path=registration.path,
            max_rank=registration.max_rank,
            max_bytes=EngineConfig().max_adapter_bytes,
        )


def alias_set(redis_url: str, name: str, tenant: str, versions: list[AliasVersion], *, as_json: bool) -> int:
    alias = asyncio.run(_set_alias(redis_url, name, tenant, versions))
    print(json.dumps(alias.to_dict()) if as_json else f"alias {_describe(alias)}")
    return 0


async def _set_alias(redis_url: str, name: str, tenant: str, versions: list[AliasVersion]) -> AdapterAlias:
    async with plain_redis(redis_url) as redis:
        if tenant != SHARED_OWNER and not await redis.sismember(keys.TENANTS, tenant):
            raise LorafleetError(
                ErrorCode.NOT_FOUND, f"tenant {tenant!r} does not exist (create it with `lorafleet tenant create`)"
            )
        return await set_alias(redis, name, tenant, versions)


def alias_list(redis_url: str) -> int:
    for alias in asyncio.run(_with_redis(redis_url, list_aliases)):
        print(_describe(alias))
    return 0


def alias_delete(redis_url: str, name: str) -> int:
    alias = asyncio.run(_with_redis(redis_url, lambda redis: delete_alias(redis, name)))
    print(f"deleted alias {alias.name}")
    return 0


async def _with_redis(redis_url: str, work: Callable[[Redis], Awaitable[T]]) -> T:
    async with plain_redis(redis_url) as redis:
        return await work(redis)


def _describe(alias: AdapterAlias) -> str:
    total = sum(v.weight for v in alias.versions)
    shares = ", ".join(f"{v.adapter} {100 * v.weight / total:g}%" for v in alias.versions)
    return f"{alias.name} (tenant {alias.tenant}, model {alias.base_model}): {shares}"
