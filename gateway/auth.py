"""`Authorization: Bearer <api key>` → the tenant the key belongs to, with a short memory.

A key that authenticated is remembered for AUTH_CACHE_TTL_S, so most requests cost no Redis round
trip for authentication, and concurrent requests with a key that is not remembered share one lookup.
A rotated key or a disabled tenant is therefore still let *read* its jobs for up to that long; it can
never *submit* one: the submit script checks the key and the tenant again (shared/rate_limits.py).
Keys that fail are never remembered.
"""

from __future__ import annotations

from aiohttp import web
from redis.asyncio import Redis

from gateway.errors import RequestError
from gateway.state import REDIS
from gateway.ttl_cache import TtlCache
from shared.errors import ErrorCode
from shared.tenants import Tenant, authenticate

AUTH_CACHE_TTL_S = 5.0
_AUTH_CACHE_ENTRIES = 100_000


class Authenticator:
    """API key → Tenant, remembered for AUTH_CACHE_TTL_S; one Redis lookup at a time per key. A key
    that fails (INVALID_API_KEY, TENANT_DISABLED) is not remembered. One per gateway process."""

    def __init__(self) -> None:
        self._tenants: TtlCache[str, Tenant] = TtlCache(AUTH_CACHE_TTL_S, _AUTH_CACHE_ENTRIES)

    def remembered(self, api_key: str) -> Tenant | None:
        """The key's tenant if it authenticated within AUTH_CACHE_TTL_S (no await: most requests' case)."""
        return self._tenants.get(api_key)

    async def tenant(self, redis: Redis, api_key: str) -> Tenant:
        tenant = await self._tenants.get_or_load(api_key, lambda: authenticate(redis, api_key))
        assert tenant is not None  # authenticate raises rather than answer None
        return tenant

    def forget_all(self) -> None:
        """After an admin changed a tenant's keys or status: this gateway checks every key again."""
        self._tenants.clear()


# the app's Authenticator (kept here, beside its class: gateway/state.py holds the other keys)
AUTHENTICATOR = web.AppKey("authenticator", Authenticator)


async def request_tenant(request: web.Request) -> Tenant:
    """The request's tenant; raise MISSING_API_KEY, INVALID_API_KEY or TENANT_DISABLED."""
    scheme, _, api_key = request.headers.get("Authorization", "").strip().partition(" ")
    api_key = api_key.strip()
    if not api_key and scheme.lower() in ("", "bearer"):
        raise RequestError(
            ErrorCode.MISSING_API_KEY, "send your API key as 'Authorization: Bearer <key>'", param="Authorization"
        )
    if scheme.lower() != "bearer":
        raise RequestError(
            ErrorCode.INVALID_API_KEY, "the Authorization header must be 'Bearer <key>'", param="Authorization"
        )
    authenticator = request.app[AUTHENTICATOR]
    return authenticator.remembered(api_key) or await authenticator.tenant(request.app[REDIS], api_key)
