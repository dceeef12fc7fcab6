"""JSON responses, encoded by orjson: every answer the gateway gives is JSON, and the standard
library's encoder (a new encoder object per call, then its str encoded again to bytes) was a
measurable part of a request's CPU (bench/gateway.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web


def json_response(data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, headers=headers, content_type="application/json")


def list_response(data: list[dict[str, Any]]) -> web.Response:
    """An OpenAI list object (`GET /v1/files`, `/v1/batches`) holding all of `data`, one page."""
    return json_response(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )
