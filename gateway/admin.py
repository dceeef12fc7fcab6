"""The admin API's authentication and adapter registration, free of HTTP views.

The admin key is configured as its SHA-256 (GatewayConfig.admin_key_sha256): the gateway never
holds the key itself. A tenant's API key on an admin route is FORBIDDEN, whatever its tenant.
"""

from __future__ import annotations

import hmac
import time

from aiohttp import web
from redis.asyncio import Redis

from gateway.errors import RequestError
from gateway.state import CONFIG
from shared.adapter_registry import AdapterRecord, register_adapter
from shared.config import GatewayConfig
from shared.errors import ErrorCode
from shared.model_registry import adapter_limits, get_model, list_models
from shared.tenants import hash_admin_key


def require_admin(request: web.Request) -> None:
    """Raise unless the request carries `Authorization: Bearer <admin key>`."""
    expected = request.app[CONFIG].admin_key_sha256
    if expected is None:
        raise RequestError(ErrorCode.ADMIN_DISABLED, "this gateway has no admin key configured")
    scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise RequestError(
            ErrorCode.MISSING_API_KEY, "send the admin key as 'Authorization: Bearer <key>'", param="Authorization"
        )
    if not hmac.compare_digest(hash_admin_key(key), expected):
        raise RequestError(ErrorCode.FORBIDDEN, "this key may not use the admin API", param="Authorization")


async def register(
    redis: Redis, config: GatewayConfig, *, name: str, owner: str, path: str, model: str | None, model_field: str
) -> AdapterRecord:
    """Validate the adapter at `path` (under config.adapter_root), against the model and what its
    workers can serve, and register it for `owner`. `model` may be omitted when the fleet serves
    exactly one base model; errors about it name `model_field`, the body field the caller sent it in."""
    if config.adapter_root is None:
        raise RequestError(ErrorCode.FORBIDDEN, "this gateway has no adapter root: it cannot register adapters")
    if model is None:
        served = await list_models(redis)
        if len(served) != 1:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, "name the base model: the fleet serves several", param=model_field
            )
        info = served[0]
    else:
        info = await get_model(redis, model)
        if info is None:
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} not found", param=model_field)
    since_ms = time.time() * 1000 - config.model_unserved_after_s * 1000  # the workers serving it now
    return await register_adapter(
        redis,
        name=name,
        tenant=owner,
        model=info,
        adapter_root=config.adapter_root,
        path=path,
        max_rank=config.max_lora_rank,
        max_bytes=config.max_adapter_bytes,
        limits=await adapter_limits(redis, info.name, since_ms=since_ms),
    )
