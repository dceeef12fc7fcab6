"""Admin API (`/v1/admin/...`, admin key only): tenants (create, list, rotate key, disable/enable,
limits), adapters (register for any tenant or "shared", list all, unregister) and adapter aliases
(set the weighted adapters, list, delete)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway import admin
from gateway.auth import AUTHENTICATOR
from gateway.errors import RequestError
from gateway.job_request import boolean, invalid
from gateway.json_body import parse_json_object
from gateway.json_response import json_response
from gateway.state import CONFIG, REDIS
from shared.adapter_aliases import AliasVersion, delete_alias, list_aliases, set_alias
from shared.adapter_registry import list_adapters, unregister_adapter
from shared.errors import ErrorCode
from shared.rate_limits import LIMIT_FIELDS, get_tenant_limits, set_tenant_limits
from shared.tenants import (
    SHARED_OWNER,
    create_tenant,
    get_tenant,
    list_tenants,
    rotate_key,
    set_disabled,
    tenant_exists,
)


def _string(body: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise invalid(name, f"{name} must be a non-empty string")
    return value


def _only(body: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(unknown[0], f"unknown field(s): {', '.join(unknown)}")
    return body


async def _tenant_view(request: web.Request, tenant_id: str, disabled: bool) -> dict[str, Any]:
    return {"tenant": tenant_id, "disabled": disabled, "limits": await get_tenant_limits(request.app[REDIS], tenant_id)}


async def create_tenant_view(request: web.Request) -> web.Response:
    """`POST /v1/admin/tenants {"name"}` → 201 with the tenant's API key (shown only here)."""
    admin.require_admin(request)
    body = _only(parse_json_object(await request.read()), {"name"})
    name = _string(body, "name")
    api_key = await create_tenant(request.app[REDIS], name)
    return json_response({"tenant": name, "api_key": api_key}, status=201)


async def list_tenants_view(request: web.Request) -> web.Response:
    admin.require_admin(request)
    tenants = await list_tenants(request.app[REDIS])
    return json_response({"data": [await _tenant_view(request, t.tenant_id, t.disabled) for t in tenants]})


async def rotate_key_view(request: web.Request) -> web.Response:
    """`POST /v1/admin/tenants/{tenant}/rotate-key` → a new key; the old one stops working."""
    admin.require_admin(request)
    tenant_id = request.match_info["tenant"]
    api_key = await rotate_key(request.app[REDIS], tenant_id)
    request.app[AUTHENTICATOR].forget_all()  # this gateway at once; the others within AUTH_CACHE_TTL_S
    return json_response({"tenant": tenant_id, "api_key": api_key})


async def update_tenant_view(request: web.Request) -> web.Response:
    """`PATCH /v1/admin/tenants/{tenant}` with `disabled` and/or `limits` ({name: int >= 1, or null
    for the gateway's default})."""
    admin.require_admin(request)
    tenant_id = request.match_info["tenant"]
    body = _only(parse_json_object(await request.read()), {"disabled", "limits"})
    redis = request.app[REDIS]
    if not await tenant_exists(redis, tenant_id):
        raise RequestError(ErrorCode.TENANT_NOT_FOUND, f"tenant {tenant_id!r} not found")
    limits = body.get("limits")
    if limits is not None:
        if not isinstance(limits, dict):
            raise invalid("limits", "limits must be an object")
        for name, value in limits.items():
            if name not in LIMIT_FIELDS:
                raise invalid(f"limits.{name}", f"unknown limit; known: {', '.join(LIMIT_FIELDS)}")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise invalid(f"limits.{name}", "a limit must be an integer >= 1, or null for the default")
        await set_tenant_limits(redis, tenant_id, limits)
    if body.get("disabled") is not None:
        await set_disabled(redis, tenant_id, boolean(body, "disabled", False))
        request.app[AUTHENTICATOR].forget_all()  # this gateway at once; the others within AUTH_CACHE_TTL_S
    tenant = await get_tenant(redis, tenant_id)
    return json_response(await _tenant_view(request, tenant_id, tenant.disabled))


async def register_adapter_view(request: web.Request) -> web.Response:
    """`POST /v1/admin/adapters {"name", "tenant", "path", "model"?}` → 201 with the record (a new version
    if the name exists and belongs to the same tenant)."""
    admin.require_admin(request)
    body = _only(parse_json_object(await request.read()), {"name", "tenant", "path", "model"})
    owner = _string(body, "tenant")
    redis = request.app[REDIS]
    if owner != SHARED_OWNER and not await tenant_exists(redis, owner):
        raise RequestError(ErrorCode.TENANT_NOT_FOUND, f"tenant {owner!r} not found", param="tenant")
    record = await admin.register(
        redis,
        request.app[CONFIG],
        name=_string(body, "name"),
        owner=owner,
        path=_string(body, "path"),
        model=_string(body, "model", required=False),
        model_field="model",
    )
    return json_response(record.to_dict(), status=201)


async def list_adapters_view(request: web.Request) -> web.Response:
    admin.require_admin(request)
    return json_response({"data": [a.to_dict() for a in await list_adapters(request.app[REDIS])]})


async def unregister_adapter_view(request: web.Request) -> web.Response:
    """`DELETE /v1/admin/adapters/{name}` → the removed record."""
    admin.require_admin(request)
    record = await unregister_adapter(request.app[REDIS], request.match_info["name"])
    return json_response(record.to_dict())


async def set_alias_view(request: web.Request) -> web.Response:
    """`PUT /v1/admin/aliases/{name} {"tenant", "versions": [{"adapter", "weight"}, ...]}` → the alias: created,
    or its adapters and weights replaced for every job submitted from now on (a rollout or a rollback)."""
    admin.require_admin(request)
    body = _only(parse_json_object(await request.read()), {"tenant", "versions"})
    owner = _string(body, "tenant")
    redis = request.app[REDIS]
    if owner != SHARED_OWNER and not await tenant_exists(redis, owner):
        raise RequestError(ErrorCode.TENANT_NOT_FOUND, f"tenant {owner!r} not found", param="tenant")
    versions = body.get("versions")
    if not isinstance(versions, list):
        raise invalid("versions", 'versions must be a list of {"adapter", "weight"}')
    parsed = []
    for index, version in enumerate(versions):
        if not isinstance(version, dict) or set(version) != {"adapter", "weight"}:
            raise invalid(f"versions[{index}]", 'each version is {"adapter": name, "weight": integer}')
        if not isinstance(version["adapter"], str):
            raise invalid(f"versions[{index}].adapter", "adapter must be a string")
        parsed.append(AliasVersion(version["adapter"], version["weight"]))
    alias = await set_alias(redis, request.match_info["name"], owner, parsed)
    return json_response(alias.to_dict())


async def list_aliases_view(request: web.Request) -> web.Response:
    admin.require_admin(request)
    return json_response({"data": [a.to_dict() for a in await list_aliases(request.app[REDIS])]})


async def delete_alias_view(request: web.Request) -> web.Response:
    """`DELETE /v1/admin/aliases/{name}` → the removed alias."""
    admin.require_admin(request)
    alias = await delete_alias(request.app[REDIS], request.match_info["name"])
    return json_response(alias.to_dict())
