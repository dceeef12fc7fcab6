"""Adapter aliases: a name tenants send as their `adapter`, mapped to a weighted list of registered
adapters (`lf:aliases`, `lf:alias:{name}`), e.g. `support` → 95 × `support-v2`, 5 × `support-v3`.

The gateway draws one adapter per job by the weights, so a canary gets its share of the traffic;
setting the weights again is a rollout or a rollback for every job submitted after it, with no cache
and no worker involved (the job carries the adapter drawn). The job record names the adapter that
served it and the alias it came through.

Isolation as for adapters: an alias is owned by a tenant or "shared", and only its owner (or every
tenant, for a shared one) may use it. Its adapters must be usable by its owner (a shared alias names
shared adapters only) and be trained for one base model. Alias and adapter names share one namespace,
so a name in a request means one thing; an adapter an alias names cannot be unregistered
(`lf:adapter-aliases:{adapter}`), so an alias never draws an adapter that is gone.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from shared import keys
from shared.adapter_registry import ADAPTER_NAME, get_adapter
from shared.errors import ErrorCode, LorafleetError
from shared.tenants import SHARED_OWNER

MAX_VERSIONS = 16


@dataclass(frozen=True, slots=True)
class AliasVersion:
    adapter: str  # a registered adapter's name
    weight: int  # its share of the alias's jobs: weight / the sum of the weights


@dataclass(frozen=True, slots=True)
class AdapterAlias:
    name: str
    tenant: str  # owning tenant, or "shared"
    base_model: str
    versions: tuple[AliasVersion, ...]
    updated_ms: int

    def visible_to(self, tenant_id: str) -> bool:
        return self.tenant in (tenant_id, SHARED_OWNER)

    def draw(self, rng: random.Random) -> str:
        """One adapter name, chosen by the weights."""
        live = [v for v in self.versions if v.weight > 0]
        return rng.choices([v.adapter for v in live], weights=[v.weight for v in live])[0]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "tenant": self.tenant,
            "base_model": self.base_model,
            "versions": [{"adapter": v.adapter, "weight": v.weight} for v in self.versions],
            "updated_ms": self.updated_ms,
        }


def _invalid(message: str) -> LorafleetError:
    return LorafleetError(ErrorCode.INVALID_REQUEST, message)


def _checked_versions(versions: list[AliasVersion]) -> tuple[AliasVersion, ...]:
    if not 1 <= len(versions) <= MAX_VERSIONS:
        raise _invalid(f"an alias names 1 to {MAX_VERSIONS} adapters")
    if len({v.adapter for v in versions}) != len(versions):
        raise _invalid("an alias names each adapter once")
    for version in versions:
        if isinstance(version.weight, bool) or not isinstance(version.weight, int) or not 0 <= version.weight <= 10_000:
            raise _invalid(f"the weight of {version.adapter!r} must be an integer from 0 to 10000")
    if sum(v.weight for v in versions) == 0:
        raise _invalid("at least one weight must be above 0")
    return tuple(versions)


async def set_alias(redis: Redis, name: str, tenant: str, versions: list[AliasVersion]) -> AdapterAlias:
    """Create alias `name` for `tenant`, or replace its adapters and weights (effective for the next job).
    CONFLICT when the name is an adapter's or another tenant's alias; ADAPTER_NOT_FOUND for an adapter
    the owner may not use; INVALID_REQUEST for bad weights or adapters of different base models."""
    if not ADAPTER_NAME.match(name):
        raise _invalid("alias name must be 1-128 chars of letters, digits, '.', '_' or '-'")
    checked = _checked_versions(versions)
    if await redis.exists(keys.adapter(name)):
        raise LorafleetError(ErrorCode.CONFLICT, f"{name!r} is an adapter's name")
    existing = await get_alias(redis, name)
    if existing is not None and existing.tenant != tenant:
        raise LorafleetError(ErrorCode.CONFLICT, f"alias {name!r} belongs to another tenant")
    base_models = set()
    for version in checked:
        adapter = await get_adapter(redis, version.adapter)
        # a shared alias serves every tenant: it may name shared adapters only
        if adapter is None or adapter.tenant not in (tenant, SHARED_OWNER):
            raise LorafleetError(ErrorCode.ADAPTER_NOT_FOUND, f"adapter {version.adapter!r} not found")
        base_models.add(adapter.base_model)
    if len(base_models) != 1:
        raise _invalid(f"an alias's adapters must share one base model, not {sorted(base_models)}")
    alias = AdapterAlias(name, tenant, base_models.pop(), checked, int(time.time() * 1000))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.alias(name), mapping={"record": json.dumps(alias.to_dict()), "tenant": tenant})
        pipe.sadd(keys.ALIASES, name)
        for version in () if existing is None else existing.versions:
            pipe.srem(keys.adapter_aliases(version.adapter), name)
        for version in checked:  # an adapter an alias names is not unregistered (shared/adapter_registry.py)
            pipe.sadd(keys.adapter_aliases(version.adapter), name)
        await pipe.execute()
    return alias


async def get_alias(redis: Redis, name: str) -> AdapterAlias | None:
    raw = await redis.hget(keys.alias(name), "record")
    if raw is None:
        return None
    data = json.loads(raw)
    versions = tuple(AliasVersion(v["adapter"], v["weight"]) for v in data["versions"])
    return AdapterAlias(data["name"], data["tenant"], data["base_model"], versions, data["updated_ms"])


async def list_aliases(redis: Redis) -> list[AdapterAlias]:
    names = sorted(name.decode() for name in await redis.smembers(keys.ALIASES))
    return [alias for alias in [await get_alias(redis, name) for name in names] if alias is not None]


async def delete_alias(redis: Redis, name: str) -> AdapterAlias:
    """Remove alias `name`: new jobs naming it get ADAPTER_NOT_FOUND (jobs already queued keep their adapter)."""
    alias = await get_alias(redis, name)
    if alias is None:
        raise LorafleetError(ErrorCode.ADAPTER_NOT_FOUND, f"alias {name!r} not found")
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.alias(name))
        pipe.srem(keys.ALIASES, name)
        for version in alias.versions:
            pipe.srem(keys.adapter_aliases(version.adapter), name)
        await pipe.execute()
    return alias
