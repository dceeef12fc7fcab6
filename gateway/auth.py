"""`Authorization: Bearer <api key>` → the tenant the key belongs to."""

from __future__ import annotations

from aiohttp import web

from gateway.errors import RequestError
from gateway.state import REDIS
from shared.errors import ErrorCode
from shared.tenants import Tenant, authenticate


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
    return await authenticate(request.app[REDIS], api_key)
