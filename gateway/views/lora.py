"""vLLM-compatible adapter loading, scoped to the caller's tenant: `POST /v1/load_lora_adapter
{"lora_name", "lora_path"[, "base_model_name"]}` registers (or re-versions) an adapter the tenant
owns; `POST /v1/unload_lora_adapter {"lora_name"}` removes one it owns. Answers are plain text, as
vLLM's; errors are the gateway's JSON errors."""

from __future__ import annotations

from aiohttp import web

from gateway import admin
from gateway.auth import request_tenant
from gateway.job_request import invalid
from gateway.json_body import parse_json_object
from gateway.state import CONFIG, REDIS
from shared.adapter_registry import unregister_adapter


def _name(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise invalid(field, f"{field} must be a non-empty string")
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    body = parse_json_object(await request.read())
    unknown = sorted(set(body) - {"lora_name", "lora_path", "base_model_name", "load_inplace"})
    if unknown:
        raise invalid(unknown[0], f"unknown field(s): {', '.join(unknown)}")
    model = body.get("base_model_name")
    if model is not None and not isinstance(model, str):
        raise invalid("base_model_name", "base_model_name must be a string")
    name = _name(body, "lora_name")
    await admin.register(
        request.app[REDIS],
        request.app[CONFIG],
        name=name,
        owner=tenant.tenant_id,
        path=_name(body, "lora_path"),
        model=model,
        model_field="base_model_name",
    )
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    body = parse_json_object(await request.read())
    unknown = sorted(set(body) - {"lora_name", "lora_int_id"})
    if unknown:
        raise invalid(unknown[0], f"unknown field(s): {', '.join(unknown)}")
    name = _name(body, "lora_name")
    await unregister_adapter(request.app[REDIS], name, owner=tenant.tenant_id)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
