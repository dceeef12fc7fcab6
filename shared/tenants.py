"""Tenants and their API keys.

A key looks like `lf_<lookup>_<secret>`. Redis keeps `lookup → tenant` and, on the tenant, only a
salted SHA-256 of the secret: the secret is 32 random bytes, so a slow password hash would add
latency to every request without adding security. Comparison is constant-time.

Reserved names: `shared` owns the adapters every tenant may use (and their directory of the adapter
root), so no tenant may be called that; a tenant given such a name before it was reserved is
refused at authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from redis.asyncio import Redis

from shared import keys
from shared.errors import ErrorCode, LorafleetError

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
SHARED_OWNER = "shared"  # owner of the adapters every tenant may use
RESERVED_TENANT_NAMES = frozenset({SHARED_OWNER})
_KEY_FORMAT = re.compile(r"^lf_([A-Za-z0-9]{16})_([A-Za-z0-9_-]{20,})$")


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    disabled: bool = False
    key_lookup: str = ""  # the lookup id of the API key that authenticated it ("" when none did)


def hash_admin_key(key: str) -> str:
    """Hex SHA-256 of the admin key: what a gateway is configured with instead of the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


def _hash_secret(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


async def create_tenant(redis: Redis, name: str) -> str:
    """Create tenant `name` and return its API key (shown once; only its hash is stored)."""
    if not TENANT_NAME.match(name):
        raise LorafleetError(
            ErrorCode.INVALID_REQUEST, "tenant name must be 1-63 chars of a-z, 0-9, '_' or '-', starting alphanumeric"
        )
    if name in RESERVED_TENANT_NAMES:
        raise LorafleetError(ErrorCode.TENANT_NAME_RESERVED, f"tenant name {name!r} is reserved")
    if not await redis.sadd(keys.TENANTS, name):
        raise LorafleetError(ErrorCode.CONFLICT, f"tenant {name!r} already exists")
    return await issue_key(redis, name)


async def issue_key(redis: Redis, tenant_id: str) -> str:
    """Give the tenant a new API key; the previous one stops working."""
    lookup = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    previous = await redis.hget(keys.tenant(tenant_id), "key_lookup")
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(
            keys.tenant(tenant_id),
            mapping={"key_lookup": lookup, "key_salt": salt, "key_hash": _hash_secret(salt, secret), "disabled": 0},
        )
        pipe.set(keys.api_key(lookup), tenant_id)
        if previous:
            pipe.delete(keys.api_key(previous.decode()))
        await pipe.execute()
    return f"lf_{lookup}_{secret}"


async def authenticate(redis: Redis, api_key: str) -> Tenant:
    """Map an API key to its tenant, or raise INVALID_API_KEY / TENANT_DISABLED."""
    match = _KEY_FORMAT.match(api_key)
    if match is None:
        raise LorafleetError(ErrorCode.INVALID_API_KEY, "the API key is not valid")
    lookup, secret = match.groups()
    tenant_id = await redis.get(keys.api_key(lookup))
    if tenant_id is None:
        raise LorafleetError(ErrorCode.INVALID_API_KEY, "the API key is not valid")
    tenant_id = tenant_id.decode()
    stored = await redis.hmget(keys.tenant(tenant_id), ["key_salt", "key_hash", "disabled"])
    salt, key_hash, disabled = stored
    if salt is None or not hmac.compare_digest(_hash_secret(salt, secret), key_hash):
        raise LorafleetError(ErrorCode.INVALID_API_KEY, "the API key is not valid")
    if disabled == b"1":
        raise LorafleetError(ErrorCode.TENANT_DISABLED, "this tenant is disabled")
    if tenant_id in RESERVED_TENANT_NAMES:  # created before the name was reserved
        raise LorafleetError(ErrorCode.FORBIDDEN, f"tenant name {tenant_id!r} is reserved: its key is refused")
    return Tenant(tenant_id, key_lookup=lookup)


async def tenant_exists(redis: Redis, tenant_id: str) -> bool:
    return bool(await redis.sismember(keys.TENANTS, tenant_id))


async def get_tenant(redis: Redis, tenant_id: str) -> Tenant | None:
    if not await tenant_exists(redis, tenant_id):
        return None
    return Tenant(tenant_id, disabled=await redis.hget(keys.tenant(tenant_id), "disabled") == b"1")


async def list_tenants(redis: Redis) -> list[Tenant]:
    names = sorted(name.decode() for name in await redis.smembers(keys.TENANTS))
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hget(keys.tenant(name), "disabled")
        flags = await pipe.execute()
    return [Tenant(name, disabled=flag == b"1") for name, flag in zip(names, flags, strict=True)]


async def set_disabled(redis: Redis, tenant_id: str, disabled: bool) -> Tenant:
    """Disable (every request with its key gets TENANT_DISABLED) or re-enable a tenant."""
    if not await tenant_exists(redis, tenant_id):
        raise LorafleetError(ErrorCode.TENANT_NOT_FOUND, f"tenant {tenant_id!r} not found")
    await redis.hset(keys.tenant(tenant_id), "disabled", int(disabled))
    return Tenant(tenant_id, disabled=disabled)


async def rotate_key(redis: Redis, tenant_id: str) -> str:
    """A new API key for an existing tenant; the old one stops working at once."""
    if not await tenant_exists(redis, tenant_id):
        raise LorafleetError(ErrorCode.TENANT_NOT_FOUND, f"tenant {tenant_id!r} not found")
    return await issue_key(redis, tenant_id)
