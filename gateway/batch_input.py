"""A batch input file's content, checked line by line at upload: UTF-8 JSONL, each line a JSON
object (as strict as a request body: gateway/json_body.py) with a unique string `custom_id`, within
the line limit. What a line asks for (its method,
URL and body) is checked when the batch runs it, so a line that asks for something invalid fails
alone, in the batch's error file."""

from __future__ import annotations

from gateway.errors import RequestError
from gateway.json_body import parse_json_object
from shared.errors import ErrorCode

MAX_CUSTOM_ID_CHARS = 512


def batch_lines(content: bytes, max_lines: int) -> list[str]:
    """The file's non-blank lines (without line ends), each checked; RequestError naming the first bad one."""
    try:
        text = content.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not content
    except UnicodeDecodeError as exc:
        raise RequestError(
            ErrorCode.INVALID_FILE_ENCODING, f"the file is not UTF-8 (byte {exc.start})", param="file"
        ) from None
    lines = [line.strip() for line in text.split("\n")]
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line]
    if not numbered:
        raise RequestError(ErrorCode.EMPTY_FILE, "the file has no lines", param="file")
    if len(numbered) > max_lines:
        raise RequestError(
            ErrorCode.FILE_TOO_MANY_LINES,
            f"the file has {len(numbered)} lines, over the limit of {max_lines}",
            param="file",
        )
    seen: set[str] = set()
    for number, line in numbered:
        custom_id = _custom_id(number, line)
        if custom_id in seen:
            raise _bad_line(number, f"custom_id {custom_id!r:.80} appears twice")
        seen.add(custom_id)
    return [line for _, line in numbered]


def _custom_id(number: int, line: str) -> str:
    try:
        data = parse_json_object(line.encode())  # as strict as a request body: a line becomes one
    except RequestError as refused:
        raise _bad_line(number, f"is not a JSON object as a request body must be: {refused.message}") from None
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise _bad_line(number, f"needs a custom_id: a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    return custom_id


def _bad_line(number: int, problem: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_JSONL, f"line {number} {problem}", param="file")
