"""`GET /v1/webhooks/key`: the caller's webhook signing key, to verify the calls its jobs' webhooks get."""

from __future__ import annotations

from aiohttp import web

from gateway.auth import request_tenant
from gateway.errors import RequestError
from gateway.json_response import json_response
from gateway.state import CONFIG
from gateway.webhook_signature import DELIVERY_HEADER, SIGNATURE_HEADER, tenant_signing_key
from shared.errors import ErrorCode


async def webhook_key(request: web.Request) -> web.Response:
    tenant = await request_tenant(request)
    webhooks = request.app[CONFIG].webhooks
    if not webhooks.enabled or webhooks.secret is None:
        raise RequestError(ErrorCode.WEBHOOK_NOT_ALLOWED, "webhooks are not enabled on this gateway")
    return json_response(
        {
            "key": tenant_signing_key(webhooks.secret, tenant.tenant_id),
            "signature_header": SIGNATURE_HEADER,
            "delivery_header": DELIVERY_HEADER,
            "scheme": "t=<unix seconds>,v1=<hex HMAC-SHA256(key, '<t>.' + body)>",
        }
    )
