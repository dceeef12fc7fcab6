"""Strict JSON request bodies: UTF-8, RFC 8259 only (no NaN/Infinity literals), no duplicate keys, and
no lone UTF-16 surrogates (`"\\ud800"` decodes in Python but no tokenizer, Redis key or msgpack
string can hold it).

Most bodies are read by orjson (a fifth of the standard library's time, with the checks below:
docs/benchmarks.md, "Figures behind code comments"), which refuses all of the above itself except repeated keys
(it keeps the last) and reads an integer outside 64 bits as a float. So its answer is taken only when
neither can have happened: the body holds one object (one `{`), whose keys account for every `:` in
it (a key is always followed by one, so a repeated key or a `:` in a string leaves more colons than
keys), and no run of 19 digits. Any other body, and any orjson refuses (`1e999`, which Python reads
as infinity and the field checks refuse by name), is read by the standard library as before.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson

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


# orjson reads an integer outside [-2**63, 2**64) as a float; every such literal has 19 digits or more,
# found as 19 zeros once every digit is a zero (translate and find: a quarter of a regular expression's time)
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object; raise INVALID_JSON or INVALID_REQUEST."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    else:
        if (
            isinstance(value, dict)
            and body.count(b":") == len(value)
            and body.count(b"{") == 1
            and _NINETEEN_DIGITS not in body.translate(_DIGITS_AS_ZEROS)
        ):
            return value
    return _strict_object(body)


def _strict_object(body: bytes) -> dict[str, Any]:
    """`parse_json_object` by the standard library's decoder, checking every object for repeated keys."""
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
