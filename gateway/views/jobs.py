"""Job API v1: submit, read (with optional long-poll), stream the events of, and cancel a job, as the
caller's tenant."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aiohttp import web

from gateway.auth import request_tenant
from gateway.errors import RequestError
from gateway.job_request import parse_job_request
from gateway.job_service import Idle, TokenEvent
from gateway.json_body import parse_json_object
from gateway.json_response import json_response
from gateway.sse import open_event_stream, send_event, send_keepalive
from gateway.state import CONFIG, JOBS, QUEUED_JOB, REQUEST_ID
from shared.errors import ErrorCode
from shared.schema import JobRecord

IDEMPOTENCY_HEADER = "Idempotency-Key"
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no spaces


async def submit_job(request: web.Request) -> web.Response:
    """`POST /v1/jobs`: 202 with the new job's id and URLs; 200 with the first job's for a repeated Idempotency-Key."""
    tenant = await request_tenant(request)
    config = request.app[CONFIG]
    job_request = parse_job_request(parse_json_object(await request.read()), config.limits, config.webhooks)
    record, created = await request.app[JOBS].submit(
        tenant, job_request, request_id=request[REQUEST_ID], idempotency_key=_idempotency_key(request)
    )
    if created:
        request[QUEUED_JOB] = record
    urls = _job_urls(record.job_id)
    return json_response(
        {"id": record.job_id, "status": record.status.value, "urls": urls},
        status=202 if created else 200,
        headers={"Location": urls["self"]},
    )


async def get_job(request: web.Request) -> web.Response:
    """`GET /v1/jobs/{job_id}[?wait=SECONDS]`: the job's state; with `wait`, held until it is terminal or
    the wait (capped at limits.max_wait_s) runs out."""
    tenant = await request_tenant(request)
    record = await request.app[JOBS].wait(tenant, request.match_info["job_id"], _wait_seconds(request))
    return json_response(job_body(record))


async def cancel_job(request: web.Request) -> web.Response:
    """`POST /v1/jobs/{job_id}/cancel`: 200 with the job's state after the call. A job that had already
    finished keeps its terminal status (the body shows which); cancelling twice is harmless."""
    tenant = await request_tenant(request)
    record = await request.app[JOBS].cancel(tenant, request.match_info["job_id"])
    return json_response(job_body(record))


def job_body(record: JobRecord) -> dict[str, Any]:
    """The public view of a job. Timings are milliseconds since submission, null until they happen."""

    def since_created(ms: int) -> int | None:
        return ms - record.created_ms if ms else None

    output = record.output
    return {
        "id": record.job_id,
        "status": record.status.value,
        "model": record.model,
        "adapter": record.adapter,
        "adapter_version": record.adapter_version or None,
        "alias": record.alias,
        "priority": record.priority.value,
        "output": None
        if output is None
        else {"text": output.text, "token_ids": list(output.token_ids), "finish_reason": output.finish_reason.value},
        "usage": {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens},
        "timings": {
            "queued_ms": since_created(record.started_ms),
            "ttft_ms": since_created(record.first_token_ms),
            "total_ms": since_created(record.finished_ms),
        },
        "error": None if record.error is None else {"code": record.error.code, "message": record.error.message},
    }


def _job_urls(job_id: str) -> dict[str, str]:
    """The job's routes (routes.py), written out: a job id needs no quoting, and building them through
    the router (yarl URLs) was a measurable part of a submit's CPU."""
    url = f"/v1/jobs/{job_id}"
    return {"self": url, "cancel": f"{url}/cancel"}


def _idempotency_key(request: web.Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not _IDEMPOTENCY_KEY.match(key):
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"{IDEMPOTENCY_HEADER} must be 1-255 printable ASCII characters without spaces",
            param=IDEMPOTENCY_HEADER,
        )
    return key


def _wait_seconds(request: web.Request) -> float:
    """The `wait` query parameter in seconds (0 when absent), capped at limits.max_wait_s."""
    raw = request.query.get("wait")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise RequestError(ErrorCode.INVALID_REQUEST, "wait must be a number of seconds >= 0", param="wait")
    return min(seconds, request.app[CONFIG].limits.max_wait_s)


_EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")


async def job_events(request: web.Request) -> web.StreamResponse:
    """`GET /v1/jobs/{job_id}/events`: the job as server-sent events: `token` events
    (`{"text", "token_ids", "offset"}`), then one `end` event with the job's body. Each event's id is
    its stream entry, so a client reconnecting with `Last-Event-ID` resumes after it."""
    tenant = await request_tenant(request)
    job_id = request.match_info["job_id"]
    after = request.headers.get("Last-Event-ID", "0-0")
    if not _EVENT_ID.match(after):
        raise RequestError(ErrorCode.INVALID_REQUEST, "Last-Event-ID must be an event id", param="Last-Event-ID")
    job = await request.app[JOBS].get(tenant, job_id)  # ownership, before the 200 goes out
    response = await open_event_stream(request)
    async for event in request.app[JOBS].events(job, after=after):
        if isinstance(event, Idle):
            await send_keepalive(response)
        elif isinstance(event, TokenEvent):
            data = {"text": event.text, "token_ids": list(event.token_ids), "offset": event.offset}
            await send_event(response, json.dumps(data), event="token", event_id=event.event_id)
        else:
            body = job_body(event.record) if event.record is not None else None
            await send_event(response, json.dumps(body), event="end", event_id=event.event_id)
    await response.write_eof()
    return response
