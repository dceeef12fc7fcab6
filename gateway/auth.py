"""`Authorization: Bearer <api key>` → the tenant the key belongs to (gateway/authenticator.py).

A key that authenticated is remembered for AUTH_CACHE_TTL_S, so most requests cost no Redis round
trip for authentication, and concurrent requests with a key that is not remembered share one lookup.
A rotated key or a disabled tenant is therefore still let *read* its jobs for up to that long; it can
never *submit* one: the submit script checks the key and the tenant again (shared/rate_limits.py).
Keys that fail are never remembered.
"""

from __future__ import annotations

from aiohttp import web

from gateway.errors import RequestError
from gateway.state import AUTHENTICATOR, REDIS
from shared.errors import ErrorCode
from shared.tenants import Tenant


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
