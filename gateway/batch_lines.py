"""One batch input line as a job, and its output or error line: an input line is
`{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": <the endpoint's request>}`;
its body is checked as the endpoint checks it, and a line that fails the check fails alone."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import RequestError, error_body, status_for
from gateway.job_request import JobRequest
from gateway.job_service import JobService
from gateway.openai_completion import completion_body, job_failure, openai_job_request
from gateway.openai_request import OpenAIRequest, parse_chat_request, parse_completion_request
from shared.config import RequestLimits
from shared.errors import ErrorCode
from shared.schema import JobRecord, Priority
from shared.tenants import Tenant

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)


def custom_id(line: str) -> str:
    """The line's custom_id (checked at upload: gateway/batch_input.py)."""
    return json.loads(line)["custom_id"]


def parse_line(line: str, endpoint: str, limits: RequestLimits) -> OpenAIRequest:
    """The line's request body, checked as `endpoint` checks it; RequestError naming what is wrong."""
    data = json.loads(line)
    method = data.get("method")
    if not isinstance(method, str) or method.upper() != "POST":
        raise RequestError(ErrorCode.INVALID_REQUEST, "method must be POST", param="method")
    if data.get("url") != endpoint:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"url must be the batch's endpoint, {endpoint}", param="url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise RequestError(ErrorCode.INVALID_REQUEST, "body must be a JSON object", param="body")
    parse = parse_chat_request if endpoint == CHAT_ENDPOINT else parse_completion_request
    parsed = parse(body, limits)
    if parsed.stream:
        raise RequestError(ErrorCode.INVALID_REQUEST, "a batch line cannot stream", param="stream")
    return parsed


async def line_job_request(
    jobs: JobService, tenant: Tenant, parsed: OpenAIRequest, endpoint: str, deadline_s: float
) -> JobRequest:
    """The batch-class job a parsed line asks for, expiring with the batch's completion window."""
    request = await openai_job_request(jobs, tenant, parsed, chat=endpoint == CHAT_ENDPOINT, priority=Priority.BATCH)
    return JobRequest(
        model=request.model,
        adapter=request.adapter,
        prompt=request.prompt,
        sampling=request.sampling,
        add_special_tokens=request.add_special_tokens,
        fit_context=request.fit_context,
        deadline_s=deadline_s,
        priority=Priority.BATCH,
    )


# lines that got no answer at all (never run, or their job's record is gone): as OpenAI writes them,
# with a null response and the error alone
_UNANSWERED = frozenset({ErrorCode.BATCH_EXPIRED, ErrorCode.BATCH_CANCELLED, ErrorCode.JOB_NOT_FOUND})


def _status(code: str) -> int:
    """The HTTP status the endpoint would have answered with; 500 for a code it does not know."""
    try:
        return status_for(ErrorCode(code))
    except ValueError:
        return 500


def output_line(line_id: str, custom: str, record: JobRecord, model: str, endpoint: str) -> tuple[str, bool]:
    """(the JSONL line for a finished job, whether it belongs in the output file rather than the error file)."""
    failure = job_failure(record)
    if failure is None:
        body = completion_body(record, model, chat=endpoint == CHAT_ENDPOINT)
        return _line(line_id, custom, (200, record.job_id, body), None), True
    code, message = failure
    return _line(line_id, custom, (_status(code), record.job_id, error_body(code, message)), failure), False


def error_line(line_id: str, custom: str, code: str, message: str, *, param: str | None = None) -> str:
    """The error-file line of a line that was refused, or never ran."""
    response = None if code in _UNANSWERED else (_status(code), None, error_body(code, message, param=param))
    return _line(line_id, custom, response, (code, message))


def _line(
    line_id: str,
    custom: str,
    response: tuple[int, str | None, dict[str, Any]] | None,  # (status, request id, body)
    error: tuple[str, str] | None,
) -> str:
    return json.dumps(
        {
            "id": line_id,
            "custom_id": custom,
            "response": None
            if response is None
            else {"status_code": response[0], "request_id": response[1], "body": response[2]},
            "error": None if error is None else {"code": error[0], "message": error[1]},
        },
        separators=(",", ":"),
    )
