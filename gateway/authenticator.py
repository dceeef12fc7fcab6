"""API key → tenant with a short memory: the Authenticator one gateway process keeps (see gateway/auth.py)."""

from __future__ import annotations

from redis.asyncio import Redis

from gateway.ttl_cache import TtlCache
from shared.tenants import Tenant, authenticate

AUTH_CACHE_TTL_S = 5.0
_AUTH_CACHE_ENTRIES = 100_000


class Authenticator:
    """API key → Tenant, remembered for AUTH_CACHE_TTL_S; one Redis lookup at a time per key. A key
    that fails (INVALID_API_KEY, TENANT_DISABLED) is not remembered."""

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
