"""The gateway's HTTP face of errors: which status each error code gets, and the JSON error body.

Every error the gateway sends is `{"error": {"code", "message"[, "param"]}}`; `param` names the
request field (or header / query parameter) at fault.
"""

from __future__ import annotations

from aiohttp import web

from gateway.json_response import json_response
from shared.errors import ErrorCode, LorafleetError

_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.EMPTY_PROMPT: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.INVALID_TOKEN_ID: 400,
    ErrorCode.ADAPTER_MODEL_MISMATCH: 400,
    ErrorCode.NO_CHAT_TEMPLATE: 400,
    ErrorCode.INVALID_CHAT_TEMPLATE: 400,
    ErrorCode.WEBHOOK_NOT_ALLOWED: 400,
    ErrorCode.INVALID_ADAPTER: 400,
    ErrorCode.ADAPTER_PATH_OUTSIDE_ROOT: 400,
    ErrorCode.ADAPTER_UNSUPPORTED: 400,
    ErrorCode.ADAPTER_RANK_TOO_LARGE: 400,
    ErrorCode.ADAPTER_SHAPE_MISMATCH: 400,
    ErrorCode.ADAPTER_TOO_LARGE: 400,
    ErrorCode.ADAPTER_EXCEEDS_MODEL_LIMITS: 400,
    ErrorCode.INVALID_ADAPTER_PATH: 400,
    ErrorCode.ADAPTER_SYMLINK: 400,
    ErrorCode.ADAPTER_FILE_MISSING: 400,
    ErrorCode.ADAPTER_FILE_NOT_REGULAR: 400,
    ErrorCode.INVALID_ADAPTER_CONFIG: 400,
    ErrorCode.ADAPTER_CONFIG_MISMATCH: 400,
    ErrorCode.INVALID_SAFETENSORS: 400,
    ErrorCode.ADAPTER_DTYPE_UNSUPPORTED: 400,
    ErrorCode.TENANT_NAME_RESERVED: 400,
    ErrorCode.INVALID_MULTIPART: 400,
    ErrorCode.INVALID_PURPOSE: 400,
    ErrorCode.FILE_TOO_MANY_LINES: 400,
    ErrorCode.INVALID_FILE_ENCODING: 400,
    ErrorCode.INVALID_JSONL: 400,
    ErrorCode.EMPTY_FILE: 400,
    ErrorCode.MISSING_API_KEY: 401,
    ErrorCode.INVALID_API_KEY: 401,
    ErrorCode.TENANT_DISABLED: 403,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.ADMIN_DISABLED: 403,
    ErrorCode.ADAPTER_PATH_FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.ADAPTER_NOT_FOUND: 404,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.TENANT_NOT_FOUND: 404,
    ErrorCode.ADAPTER_PATH_NOT_FOUND: 404,
    ErrorCode.FILE_NOT_FOUND: 404,
    ErrorCode.BATCH_NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.CONFLICT: 409,
    ErrorCode.FILE_QUOTA_EXCEEDED: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.FILE_TOO_LARGE: 413,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.MODEL_UNAVAILABLE: 503,
    ErrorCode.REPLICA_UNAVAILABLE: 503,
    ErrorCode.REDIS_UNAVAILABLE: 503,
    ErrorCode.COMPLETION_TIMEOUT: 504,
}


class RequestError(LorafleetError):
    """A LorafleetError caused by one named part of the request (`param`: a body field, header or query key);
    `retry_after_s` becomes a Retry-After header (429s)."""

    def __init__(
        self, code: ErrorCode, message: str, *, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(code, message)
        self.param = param
        self.retry_after_s = retry_after_s


def status_for(code: ErrorCode) -> int:
    """The HTTP status for an error code; codes a client cannot cause (worker-side ones) are 500."""
    return _STATUS.get(code, 500)


def error_body(code: ErrorCode | str, message: str, *, param: str | None = None) -> dict[str, dict[str, str]]:
    error: dict[str, str] = {"code": str(code), "message": message}
    if param is not None:
        error["param"] = param
    return {"error": error}


def error_response(
    code: ErrorCode,
    message: str,
    *,
    status: int | None = None,
    param: str | None = None,
    retry_after_s: int | None = None,
) -> web.Response:
    """The JSON error response for `code` (status from `status_for` unless given)."""
    status = status_for(code) if status is None else status
    headers = {"WWW-Authenticate": 'Bearer realm="lorafleet"'} if status == 401 else {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return json_response(error_body(code, message, param=param), status=status, headers=headers)
