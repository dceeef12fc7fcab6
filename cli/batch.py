"""`lorafleet batch submit FILE --model M [--adapter A]` and `lorafleet batch get ID --output FILE`:
the OpenAI Batch API through the gateway, standard-library HTTP only.

FILE is JSONL: each line an OpenAI batch line (`custom_id`, `method`, `url`, `body`) or just a request
body (`{"prompt": ...}` or `{"messages": [...]}`, with an optional `custom_id`; the line's number
otherwise). Every line is sent to `--model` (with `--adapter`: `MODEL:ADAPTER`), on
/v1/chat/completions when its body has messages, else /v1/completions (one endpoint per batch).
`submit` uploads the file, creates the batch and, unless --no-wait, follows it with a progress bar.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from cli.config_from_args import SubmitTarget
from cli.errors import CommandError
from cli.submit import call_gateway, send

_HTTP_TIMEOUT_S = 60.0
_POLL_S = 1.0
_TERMINAL = ("completed", "failed", "expired", "cancelled")
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def batch_lines(path: Path, model: str) -> tuple[str, bytes]:
    """(endpoint, JSONL content) of FILE with every line's model set to `model`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {path}: {exc}") from None
    endpoints: set[str] = set()
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            raise CommandError(f"{path}:{number}: not JSON") from None
        if not isinstance(item, dict):
            raise CommandError(f"{path}:{number}: not a JSON object")
        body = (
            item["body"] if isinstance(item.get("body"), dict) else {k: v for k, v in item.items() if k != "custom_id"}
        )
        endpoint = _CHAT if "messages" in body else _COMPLETIONS
        endpoints.add(endpoint)
        custom_id = item.get("custom_id", f"line-{number}")
        lines.append({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": {**body, "model": model}})
    if not lines:
        raise CommandError(f"{path} has no lines")
    if len(endpoints) > 1:
        raise CommandError(f"{path} mixes chat (messages) and completion (prompt) lines: one kind per batch")
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return endpoints.pop(), content


def multipart_body(purpose: str, filename: str, content: bytes) -> tuple[bytes, str]:
    boundary = f"lorafleet{secrets.token_hex(12)}"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


class _ProgressBar:
    """`[#####.....] 512/1000 lines (3 failed) in_progress 12s`, redrawn in place on a terminal; a line per
    status change otherwise."""

    _WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._last: str | None = None

    def show(self, batch: dict[str, Any], elapsed_s: float) -> None:
        counts = batch["request_counts"]
        done, total = counts["completed"] + counts["failed"], counts["total"]
        filled = self._WIDTH * done // total if total else 0
        bar = "#" * filled + "." * (self._WIDTH - filled)
        text = f"[{bar}] {done}/{total} lines ({counts['failed']} failed) {batch['status']} {elapsed_s:.0f}s"
        if self._tty:
            self._stream.write(f"\r\033[K{text}")
        elif batch["status"] != self._last:
            self._stream.write(text + "\n")
        self._stream.flush()
        self._last = batch["status"]

    def close(self) -> None:
        if self._tty and self._last is not None:
            self._stream.write("\n")
            self._stream.flush()


def submit_batch(target: SubmitTarget, path: Path, model: str, *, wait: bool, timeout_s: float) -> int:
    """Upload FILE, create its batch, print the batch id; with `wait`, follow it to its end."""
    endpoint, content = batch_lines(path, model)
    body, content_type = multipart_body("batch", path.name, content)
    uploaded = json.loads(send(target, "POST", "/v1/files", _HTTP_TIMEOUT_S, body, content_type))
    request = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}
    batch = call_gateway(target, "POST", "/v1/batches", _HTTP_TIMEOUT_S, request)
    print(batch["id"])
    if not wait:
        return 0
    started = time.monotonic()
    progress = _ProgressBar(sys.stderr)
    try:
        while batch["status"] not in _TERMINAL:
            progress.show(batch, time.monotonic() - started)
            if time.monotonic() - started >= timeout_s:
                raise CommandError(
                    f"batch {batch['id']} is still {batch['status']} after {timeout_s:g}s", code="timeout"
                )
            time.sleep(_POLL_S)
            batch = call_gateway(target, "GET", f"/v1/batches/{batch['id']}", _HTTP_TIMEOUT_S)
        progress.show(batch, time.monotonic() - started)
    finally:
        progress.close()
    if batch["status"] != "completed":
        raise CommandError(f"batch {batch['id']} ended {batch['status']}", code=batch["status"])
    return 0


def get_batch(target: SubmitTarget, batch_id: str, output: Path, errors: Path | None) -> int:
    """Write a finished batch's output (and error) lines; CommandError while it is still running."""
    batch = call_gateway(target, "GET", f"/v1/batches/{batch_id}", _HTTP_TIMEOUT_S)
    if batch["status"] not in _TERMINAL:
        raise CommandError(f"batch {batch_id} is {batch['status']}: no output yet", code="not_finished")
    for file_id, destination in ((batch["output_file_id"], output), (batch["error_file_id"], errors)):
        if destination is None:
            continue
        content = (
            b""
            if file_id is None
            else send(target, "GET", f"/v1/files/{file_id}/content", _HTTP_TIMEOUT_S, None, "application/json")
        )
        destination.write_bytes(content)
    counts = batch["request_counts"]
    done = f"{counts['completed']} completed, {counts['failed']} failed of {counts['total']}"
    print(f"{batch_id}: {batch['status']}, {done}")
    return 0
