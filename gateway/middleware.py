"""The gateway's one middleware: request id, JSON errors, request metrics and the access log line.

One layer rather than three nested ones: each layer is a coroutine and a try block on every request
(bench/gateway.py measures the gateway's CPU per request against a bare aiohttp handler).
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import RequestError, error_response
from gateway.state import METRICS, QUEUED_JOB, REQUEST_ID
from shared.errors import ErrorCode, LorafleetError
from shared.log import info_line

REQUEST_ID_HEADER = "X-Request-ID"
# a client's id is kept only if it is safe to echo in a header and a log line
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_HTTP_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED, 413: ErrorCode.PAYLOAD_TOO_LARGE}

log = structlog.get_logger(__name__)


# Request ids only need to be unique, not unguessable: a random per-process prefix and a counter,
# so a request costs no read of the OS's random source (slow on a busy machine: bench/gateway.py).
_REQUEST_ID_PREFIX = uuid.uuid4().hex[:12]
_request_counter = itertools.count()


def _new_request_id() -> str:
    return f"{_REQUEST_ID_PREFIX}{next(_request_counter):020x}"


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Take the client's X-Request-ID (or make one), bind it to every log line of the request and echo
    it back; answer every failure with a JSON error; count and time the request by route and status;
    and log one line per request with its id, status, duration in milliseconds and the job it queued
    (shared.log.info_line: structlog's processor chain was most of the line's cost).

    The handler is awaited here, not through a helper coroutine: every coroutine between the request's
    task and the handler is resumed each time the handler's awaits complete (twice a submit)."""
    started = time.perf_counter()
    supplied = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = supplied if _CLIENT_REQUEST_ID.match(supplied) else _new_request_id()
    request[REQUEST_ID] = request_id
    # aiohttp runs each request in a task of its own, on a copy of the context: a variable bound here
    # is this request's alone and goes with its task, so it needs no unbinding
    structlog.contextvars.bind_contextvars(request_id=request_id)
    status = 500  # what the metrics say of an exception that escapes (a cancelled request)
    try:
        try:
            response = await handler(request)
        except Exception as exc:  # web.HTTPException below 400 (a redirect) is raised on
            response = _error_response(request, exc)
        status = response.status
    finally:
        seconds = time.perf_counter() - started
        request.app[METRICS].observe_request(request.method, _route(request), status, seconds)
    if not response.prepared:  # an event stream sent its headers already (with the id)
        response.headers[REQUEST_ID_HEADER] = request_id
    line: dict[str, Any] = {
        "method": request.method,
        "path": request.path,
        "status": status,
        "duration_ms": round(seconds * 1000, 2),
        "request_id": request_id,
    }
    job = request.get(QUEUED_JOB)
    if job is not None:  # the job the request queued
        line |= {"job_id": job.job_id, "tenant": job.tenant, "model": job.model, "adapter": job.adapter}
        if job.alias is not None:  # the adapter above is the one the alias drew
            line["alias"] = job.alias
    info_line("request", line)
    return response


def _error_response(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The JSON error for what a handler raised: domain errors by their code, aiohttp's HTTP errors
    (unknown route, wrong method, body too large) by their status, and anything else a logged 500
    `internal_error` that shows the request id but never the exception. A redirect is raised again."""
    if isinstance(exc, LorafleetError):
        param, retry_after_s = (exc.param, exc.retry_after_s) if isinstance(exc, RequestError) else (None, None)
        response = error_response(exc.code, exc.message, param=param, retry_after_s=retry_after_s)
        if response.status >= 500:
            log.error("domain_error", code=exc.code.value, message=exc.message)
        return response
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return _http_error(request, exc)
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):  # past the client's retries: try again later
        log.error("redis_unavailable", method=request.method, path=request.path, error=str(exc))
        return error_response(ErrorCode.REDIS_UNAVAILABLE, "the job store is unreachable; retry later")
    log.exception("unhandled_error", method=request.method, path=request.path)
    return error_response(ErrorCode.INTERNAL_ERROR, f"internal error (request id {request[REQUEST_ID]})")


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    code = _HTTP_CODES.get(exc.status, ErrorCode.INVALID_REQUEST if exc.status < 500 else ErrorCode.INTERNAL_ERROR)
    if code is ErrorCode.NOT_FOUND:
        message = f"no such endpoint: {request.path}"
    elif code is ErrorCode.METHOD_NOT_ALLOWED:
        message = f"{request.method} is not allowed on {request.path}"
    elif code is ErrorCode.PAYLOAD_TOO_LARGE:
        message = f"the request body is larger than {request.client_max_size} bytes"
    else:
        message = exc.reason
    response = error_response(code, message, status=exc.status)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def _route(request: web.Request) -> str:
    """The route's pattern (`/v1/jobs/{job_id}`), never the raw path: label values stay few."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"
