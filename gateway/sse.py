"""Server-sent events: open a `text/event-stream` response and write events and keep-alive comments."""

from __future__ import annotations

from aiohttp import web

from gateway.middleware import REQUEST_ID_HEADER
from gateway.state import REQUEST_ID


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    """Start a 200 event stream (headers go out now, so errors after this are sent as events)."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies such as nginx must not buffer the stream
            REQUEST_ID_HEADER: request[REQUEST_ID],
        }
    )
    await response.prepare(request)
    return response


async def send_event(
    response: web.StreamResponse, data: str, *, event: str | None = None, event_id: str | None = None
) -> None:
    """One event; `data` must be one line (JSON is)."""
    lines = ([f"id: {event_id}"] if event_id else []) + ([f"event: {event}"] if event else []) + [f"data: {data}"]
    await response.write(("\n".join(lines) + "\n\n").encode())


async def send_keepalive(response: web.StreamResponse) -> None:
    await response.write(b": keep-alive\n\n")
