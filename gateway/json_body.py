"""Strict JSON request bodies: UTF-8, RFC 8259 only (no NaN/Infinity literals), no duplicate keys, and
no lone UTF-16 surrogates (`"\\ud800"` decodes in Python but no tokenizer, Redis key or msgpack
string can hold it)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from gateway.errors import RequestError
from shared.errors import ErrorCode


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        duplicates = sorted(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"duplicate key(s) {', '.join(map(repr, duplicates))}")
    return obj


def _strings(value: Any) -> Iterator[str]:
    """Every string in a decoded JSON value, keys included (iteratively: nesting depth is the client's)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


# built once: json.loads with hooks builds a new decoder (and its scanner) on every call
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_object)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object; raise INVALID_JSON or INVALID_REQUEST."""
    try:
        value = _DECODER.decode(body.decode("utf-8"))
        # strict UTF-8 has no surrogates, so only a \u escape can decode to a lone one
        if b"\\u" in body:
            for text in _strings(value):
                text.encode("utf-8")  # raises on a lone surrogate
    except (ValueError, RecursionError) as exc:  # Unicode{De,En}codeError and JSONDecodeError are ValueErrors
        raise RequestError(ErrorCode.INVALID_JSON, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise RequestError(ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
    return value
