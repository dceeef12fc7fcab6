"""`lorafleet submit`: queue one job through the gateway's HTTP API and wait for its result.

POST /v1/jobs, then long-poll GET /v1/jobs/{id}?wait=... until the job is terminal, with a
progress line (status and elapsed time) on stderr. Standard-library HTTP only.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from cli.config_from_args import SubmitTarget
from cli.errors import CommandError

_POLL_WAIT_S = 1.0  # each GET returns at once when the job finishes, else after this long (a progress tick)
_HTTP_SLACK_S = 10.0  # beyond the server's wait, before a GET counts as hung
_TERMINAL = ("succeeded", "failed", "canceled", "expired")


def call_gateway(
    target: SubmitTarget, method: str, path: str, timeout_s: float, body: dict | None = None
) -> dict[str, Any]:
    """One JSON request to the gateway as the target's tenant; CommandError for any failure."""
    data = None if body is None else json.dumps(body).encode()
    answer = send(target, method, path, timeout_s, data, "application/json")
    try:
        return json.loads(answer)
    except ValueError as exc:
        raise CommandError(f"the gateway answered {method} {path} with something that is not JSON: {exc}") from None


def send(
    target: SubmitTarget, method: str, path: str, timeout_s: float, data: bytes | None, content_type: str
) -> bytes:
    """One request to the gateway as the target's tenant: the response's body; CommandError for any failure."""
    request = urllib.request.Request(
        target.gateway_url + path,
        method=method,
        data=data,
        headers={"Authorization": f"Bearer {target.api_key}", "Content-Type": content_type},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise _http_error(exc) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CommandError(f"cannot reach the gateway at {target.gateway_url}: {reason}") from None


def _http_error(exc: urllib.error.HTTPError) -> CommandError:
    """The gateway's `{"error": {"code", "message"}}` body; a 4xx means the request itself was refused (exit 2)."""
    exit_code = 2 if 400 <= exc.code < 500 else 1
    try:
        error = json.loads(exc.read())["error"]
        return CommandError(error["message"], code=error["code"], exit_code=exit_code)
    except (ValueError, KeyError, TypeError):
        return CommandError(f"HTTP {exc.code} {exc.reason}", exit_code=exit_code)


class _Progress:
    """`⠋ running 3.2s` redrawn in place on a terminal; one line per status change otherwise."""

    _FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._last_status: str | None = None
        self._ticks = 0

    def show(self, job_id: str, status: str, elapsed_s: float) -> None:
        if self._tty:
            frame = self._FRAMES[self._ticks % len(self._FRAMES)]
            self._stream.write(f"\r\033[K{frame} job {job_id}: {status} {elapsed_s:.1f}s")
        elif status != self._last_status:
            self._stream.write(f"job {job_id}: {status} ({elapsed_s:.1f}s)\n")
        self._stream.flush()
        self._ticks += 1
        self._last_status = status

    def clear(self) -> None:
        if self._tty and self._ticks:
            self._stream.write("\r\033[K")
            self._stream.flush()


def submit(target: SubmitTarget, body: dict[str, Any], *, timeout_s: float, as_json: bool) -> int:
    """Submit `body`, wait for the job, print its text (or the whole job as JSON); raise CommandError if it
    did not succeed."""
    started = time.monotonic()
    progress = _Progress(sys.stderr)
    job = call_gateway(target, "POST", "/v1/jobs", _HTTP_SLACK_S, body)
    job_id = job["id"]
    try:
        while job["status"] not in _TERMINAL:
            elapsed = time.monotonic() - started
            progress.show(job_id, job["status"], elapsed)
            if elapsed >= timeout_s:
                raise CommandError(f"job {job_id} is still {job['status']} after {timeout_s:g}s", code="timeout")
            wait = min(_POLL_WAIT_S, timeout_s - elapsed)
            job = call_gateway(target, "GET", f"/v1/jobs/{job_id}?wait={wait:.3f}", wait + _HTTP_SLACK_S)
    finally:
        progress.clear()
    if as_json:
        print(json.dumps(job, indent=2))
    elif job["status"] == "succeeded":
        print(job["output"]["text"])
    if job["status"] != "succeeded":
        error = job.get("error") or {}
        raise CommandError(
            error.get("message", f"job {job_id} was {job['status']}"), code=error.get("code", job["status"])
        )
    return 0
