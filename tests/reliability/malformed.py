"""A seeded corpus of malformed HTTP requests for any route table: wrong types, huge and deeply
nested JSON, invalid UTF-8, NaN/Infinity, negative and huge numbers, unknown fields, bad headers,
bad query strings and path parameters. The same seed always gives the same corpus."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

JOB_FIELDS = (
    "model", "adapter", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "ignore_eos", "messages", "stream", "n", "deadline_s", "priority",
)  # fmt: skip
ODD_NUMBERS = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e309",
    "-1e309",
    "-1",
    "0",
    "-0.0",
    "1e-320",
    "9" * 400,
    "-" + "9" * 40,
)
ODD_STRINGS = ("", " ", "\x00", "\u202e", "\U0001f600" * 50, "a" * 70_000, "../../etc/passwd", "%00", "😀", "\\")


@dataclass(frozen=True, slots=True)
class Malformed:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None


class Corpus:
    def __init__(self, seed: int, routes: list[tuple[str, str]], api_key: str, job_ids: list[str]) -> None:
        """`routes`: (method, path template with {param}s); `job_ids`: real ids to put in paths."""
        self.rng = random.Random(seed)
        self.routes = routes
        self.api_key = api_key
        self.job_ids = job_ids

    def requests(self, count: int) -> list[Malformed]:
        return [self.request() for _ in range(count)]

    def request(self) -> Malformed:
        rng = self.rng
        method, template = rng.choice(self.routes)
        if rng.random() < 0.05:
            method = rng.choice(["PUT", "DELETE", "PATCH", "GET", "POST"])  # a wrong method: 405, never 5xx
        path = re.sub(r"\{[^}]+\}", lambda _: self._path_param(), template) + self._query()
        body = self._body() if method in ("POST", "PUT", "PATCH") or rng.random() < 0.1 else None
        return Malformed(method, path, self._headers(), body)

    def _path_param(self) -> str:
        rng = self.rng
        choices = [
            lambda: rng.choice(self.job_ids) if self.job_ids else "job_x",
            lambda: "job_" + "".join(rng.choices("0123456789abcdef", k=rng.randint(0, 64))),
            lambda: quote(rng.choice(ODD_STRINGS)[:300], safe=""),
            lambda: "x" * rng.randint(1, 4000),
        ]
        return rng.choice(choices)()

    def _query(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:
            return ""
        names = ["wait", "stream", "after", "limit", rng.choice(JOB_FIELDS), "x" * rng.randint(1, 50)]
        pairs = [
            f"{quote(rng.choice(names))}={quote(rng.choice(ODD_NUMBERS + ODD_STRINGS)[:200])}"
            for _ in range(rng.randint(1, 3))
        ]
        return "?" + "&".join(pairs)

    def _headers(self) -> dict[str, str]:
        rng = self.rng
        auth = rng.choice(
            [
                f"Bearer {self.api_key}",
                f"Bearer {self.api_key}",
                "",
                "Bearer",
                "Bearer ",
                f"Basic {self.api_key}",
                "Bearer " + "k" * rng.randint(1, 9000),
                f"bearer  {self.api_key}  ",
                "Bearer lf_" + "".join(rng.choices("abcdefXYZ_-.", k=40)),
                "Bearer \u00ff\u00fe",
            ]
        )
        headers = {"Authorization": auth} if auth else {}
        if rng.random() < 0.5:
            headers["Content-Type"] = rng.choice(
                ["application/json", "text/plain", "application/json; charset=latin-1", "multipart/form-data", "x/y"]
            )
        if rng.random() < 0.2:
            headers["Idempotency-Key"] = rng.choice(["", "k" * rng.randint(1, 5000), "\u00e9t\u00e9", "a b\tc"])
        if rng.random() < 0.1:
            headers["Accept"] = rng.choice(["text/event-stream", "*/*", "application/xml", "\u00ff"])
        return headers

    def _body(self) -> bytes:
        rng = self.rng
        makers = [self._mutated_job, self._mutated_job, self._mutated_job, self._random_json, self._raw_bytes]
        return rng.choice(makers)()

    def _mutated_job(self) -> bytes:
        """A plausible job with some fields replaced by wrong, extreme or unknown values."""
        rng = self.rng
        job: dict[str, Any] = {"model": rng.choice(["demo", "tiny", "", "x" * 300]), "prompt": "hello world"}
        for _ in range(rng.randint(1, 4)):
            job[rng.choice((*JOB_FIELDS, "unknown_" + str(rng.randint(0, 9))))] = self._value(depth=0)
        text = json.dumps(job)
        for literal in ("NaN", "Infinity", "-Infinity", "9" * 5000, "1e999"):  # numbers json.dumps cannot write
            if rng.random() < 0.08:
                text = text[:-1] + f', "{rng.choice(JOB_FIELDS)}": {literal}}}'
        return text.encode()

    def _value(self, depth: int) -> Any:
        rng = self.rng
        kind = rng.randint(0, 9 if depth < 4 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.choice([True, False])
        if kind == 2:
            return rng.choice([-1, 0, 1, 2**31, 2**63, -(2**63) - 1, 10**30, rng.randint(-(10**6), 10**6)])
        if kind == 3:
            return rng.choice([0.5, -0.5, 1e308, -1e308, 5e-324, rng.uniform(-1e6, 1e6)])
        if kind in (4, 5):
            return rng.choice(ODD_STRINGS)[: rng.randint(0, 3000)]
        if kind == 6:
            return "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(0, 40)))
        if kind in (7, 8):
            return [self._value(depth + 1) for _ in range(rng.randint(0, 5))]
        return {
            rng.choice((*JOB_FIELDS, "role", "content", "")): self._value(depth + 1) for _ in range(rng.randint(0, 4))
        }

    def _random_json(self) -> bytes:
        rng = self.rng
        if rng.random() < 0.3:
            depth = rng.randint(100, 100_000)
            return (rng.choice(["[", '{"a":']) * depth).encode()  # deep nesting, unterminated
        return json.dumps(self._value(depth=0)).encode()

    def _raw_bytes(self) -> bytes:
        rng = self.rng
        choices = [
            lambda: bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 300))),
            lambda: b'{"model": "demo", "prompt": "' + bytes([0xFF, 0xFE, 0xC0, 0x80]) + b'"}',
            lambda: b'{"model": "demo", "prompt": "\\ud800"}',
            lambda: b"{" * rng.randint(1, 10) + b"}" * rng.randint(0, 10),
            lambda: b"\xef\xbb\xbf" + b'{"model": "demo", "prompt": "hi"}',  # a UTF-8 byte-order mark
            lambda: b'{"model": "demo", "prompt": "' + b"x" * rng.randint(60_000, 1_100_000) + b'"}',
        ]
        return rng.choice(choices)()
