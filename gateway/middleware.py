"""Middlewares, outermost first as `create_app` lists them: request ids, metrics, errors → JSON."""

from __future__ import annotations

import itertools
import re
import time
import uuid

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.errors import RequestError, error_response
from gateway.state import METRICS, REQUEST_ID
from shared.errors import ErrorCode, LorafleetError

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
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Take the client's X-Request-ID (or make one), bind it to every log line of the request, echo it
    back, and log one line per request with its status and duration in milliseconds."""
    supplied = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = supplied if _CLIENT_REQUEST_ID.match(supplied) else _new_request_id()
    request[REQUEST_ID] = request_id
    started = time.perf_counter()
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        response = await handler(request)
        if not response.prepared:  # an event stream sent its headers already (with the id)
            response.headers[REQUEST_ID_HEADER] = request_id
        duration_ms = round((time.perf_counter() - started) * 1000, 2)
        log.info("request", method=request.method, path=request.path, status=response.status, duration_ms=duration_ms)
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON error body: domain errors by their code, aiohttp's HTTP errors
    (unknown route, wrong method, body too large) by their status, and anything else into a logged
    500 `internal_error` that shows the request id but never the exception."""
    try:
        return await handler(request)
    except LorafleetError as exc:
        param, retry_after_s = (exc.param, exc.retry_after_s) if isinstance(exc, RequestError) else (None, None)
        response = error_response(exc.code, exc.message, param=param, retry_after_s=retry_after_s)
        if response.status >= 500:
            log.error("domain_error", code=exc.code.value, message=exc.message)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except Exception:
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


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count and time every request; sits inside the request-id middleware, outside the error one, so
    it sees the status errors are sent with."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        metrics = request.app[METRICS]
        route = _route(request)
        metrics.requests.labels(request.method, route, str(status)).inc()
        metrics.latency.labels(request.method, route).observe(time.perf_counter() - started)
