"""Load test for a running lorafleet stack (Locust).

Two kinds of users, as the gateway's clients come:
- JobUser submits async jobs (`POST /v1/jobs`) and long-polls them to completion; the whole job is
  one more row in the stats ("job adapter" / "job base", type JOB).
- CompletionsUser calls OpenAI's `POST /v1/completions` with `model: BASE:ADAPTER`; a share of them
  stream (`stream: true`), and those report their time to the first text chunk ("completion TTFT")
  and to `[DONE]` ("completion stream", type SSE) as rows of their own.

Tenants and adapters come from a `lorafleet up` state dir's demo.json (or LORAFLEET_TENANTS_FILE with
the same shape); which tenant/adapter a request uses follows Zipf(alpha) over all (tenant, adapter)
pairs, so a few adapters are hot and most are cold, as in real multi-tenant traffic.

    pip install -e ".[load]"
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s --csv out/run
    python loadtest/report.py out/run --out out/report          # plots + summary.md

Only one kind: name its class last on the command line (`... --csv out/run CompletionsUser`).

Settings (environment): LORAFLEET_STATE_DIR (default .lorafleet), LORAFLEET_ZIPF_ALPHA (1.0),
LORAFLEET_MAX_TOKENS (mean output tokens, 32), LORAFLEET_PROMPT_WORDS (mean prompt words, 24),
LORAFLEET_LENGTHS (how lengths vary around those means: exponential, the default, or fixed),
LORAFLEET_BASE_FRACTION (share of requests without an adapter, 0.1), LORAFLEET_JOB_WEIGHT and
LORAFLEET_OPENAI_WEIGHT (how users split between the two kinds, 3 and 1), LORAFLEET_STREAM_FRACTION
(share of completions that stream, 0.5).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from locust import HttpUser, between, events, task

_PROMPT_TEXT = "the quick brown fox jumps over a lazy dog while seven tenants share one patient GPU"
_WORDS = _PROMPT_TEXT.split()


@dataclass(frozen=True, slots=True)
class Target:
    api_key: str
    model: str
    adapter: str | None


@dataclass(frozen=True, slots=True)
class Request:
    """One request's draw: who sends it, with which adapter (None: the base model), and its lengths."""

    target: Target
    adapter: str | None
    prompt: str
    max_tokens: int

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.target.api_key}"}


def _load_targets() -> list[Target]:
    path = Path(
        os.environ.get(
            "LORAFLEET_TENANTS_FILE", Path(os.environ.get("LORAFLEET_STATE_DIR", ".lorafleet")) / "demo.json"
        )
    )
    demo = json.loads(path.read_text())
    model = demo["models"][0]
    return [Target(t["api_key"], model, adapter) for t in demo["tenants"] for adapter in t["adapters"]]


def _zipf_weights(count: int, alpha: float) -> list[float]:
    """P(rank k) ∝ 1 / k^alpha: rank 1 is the hottest adapter."""
    return [1.0 / (rank**alpha) for rank in range(1, count + 1)]


TARGETS = _load_targets()
WEIGHTS = _zipf_weights(len(TARGETS), float(os.environ.get("LORAFLEET_ZIPF_ALPHA", "1.0")))
MEAN_TOKENS = int(os.environ.get("LORAFLEET_MAX_TOKENS", "32"))
MEAN_WORDS = int(os.environ.get("LORAFLEET_PROMPT_WORDS", "24"))
LENGTHS = os.environ.get("LORAFLEET_LENGTHS", "exponential")
BASE_FRACTION = float(os.environ.get("LORAFLEET_BASE_FRACTION", "0.1"))
STREAM_FRACTION = float(os.environ.get("LORAFLEET_STREAM_FRACTION", "0.5"))
if LENGTHS not in ("exponential", "fixed"):
    raise ValueError(f"LORAFLEET_LENGTHS must be exponential or fixed, got {LENGTHS!r}")


def _length(mean: int) -> int:
    return mean if LENGTHS == "fixed" else max(1, int(random.expovariate(1 / mean)))


def draw_request() -> Request:
    target = random.choices(TARGETS, weights=WEIGHTS)[0]
    adapter = target.adapter if random.random() >= BASE_FRACTION else None
    prompt = " ".join(random.choices(_WORDS, k=_length(MEAN_WORDS)))
    return Request(target, adapter, prompt, _length(MEAN_TOKENS))


def _report(request_type: str, name: str, started: float, length: int, error: str | None) -> None:
    """One row in Locust's stats for something longer than one HTTP request (a job, a stream)."""
    events.request.fire(
        request_type=request_type,
        name=name,
        response_time=(time.perf_counter() - started) * 1000,
        response_length=length,
        exception=None if error is None else RuntimeError(error),
        context={},
    )


class JobUser(HttpUser):
    """Submits a job, then long-polls it; reports the whole job as one "job" request in the stats."""

    weight = int(os.environ.get("LORAFLEET_JOB_WEIGHT", "3"))
    wait_time = between(0.0, 0.5)

    @task
    def submit_and_wait(self) -> None:
        request = draw_request()
        body = {
            "model": request.target.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.8,
        }
        if request.adapter is not None:
            body["adapter"] = request.adapter
        started = time.perf_counter()
        with self.client.post(
            "/v1/jobs", json=body, headers=request.headers, name="POST /v1/jobs", catch_response=True
        ) as r:
            if r.status_code != 202:
                r.failure(f"submit: {r.status_code} {r.text[:200]}")
                return
            job_id = r.json()["id"]
        status = "queued"
        while status in ("queued", "running"):
            with self.client.get(
                f"/v1/jobs/{job_id}?wait=30",
                headers=request.headers,
                name="GET /v1/jobs/{id}?wait",
                catch_response=True,
            ) as r:
                if r.status_code != 200:
                    r.failure(f"poll: {r.status_code}")
                    return
                job = r.json()
                status = job["status"]
        succeeded = status == "succeeded"
        _report(
            "JOB",
            f"job {'adapter' if request.adapter is not None else 'base'}",
            started,
            job["usage"]["completion_tokens"] if succeeded else 0,
            None if succeeded else f"job {status}: {job.get('error')}",
        )


class CompletionsUser(HttpUser):
    """OpenAI `POST /v1/completions` (`model: BASE:ADAPTER`), streamed for LORAFLEET_STREAM_FRACTION of them."""

    weight = int(os.environ.get("LORAFLEET_OPENAI_WEIGHT", "1"))
    wait_time = between(0.0, 0.5)

    @task
    def complete(self) -> None:
        request = draw_request()
        model = request.target.model if request.adapter is None else f"{request.target.model}:{request.adapter}"
        body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.8}
        if random.random() < STREAM_FRACTION:
            self._stream(request, body)
            return
        with self.client.post(
            "/v1/completions", json=body, headers=request.headers, name="POST /v1/completions", catch_response=True
        ) as r:
            if r.status_code != 200:
                r.failure(f"completion: {r.status_code} {r.text[:200]}")
            elif r.json()["usage"]["completion_tokens"] < 1:
                r.failure(f"completion without tokens: {r.text[:200]}")

    def _stream(self, request: Request, body: dict) -> None:
        """Read the SSE chunks to `[DONE]`; the first chunk with text is the time to first token."""
        started = time.perf_counter()
        error, first_text, texts = None, None, 0
        with self.client.post(
            "/v1/completions",
            json={**body, "stream": True},
            headers=request.headers,
            name="POST /v1/completions stream",
            stream=True,
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"stream: {r.status_code} {r.text[:200]}")
                return
            done = False
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: "):
                    continue  # keep-alive comments, blank separators
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = f"stream error: {chunk['error']}"
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    texts += 1
                    if first_text is None:
                        first_text = time.perf_counter()
                        _report("SSE", "completion TTFT", started, 0, None)
            if error is None and not done:
                error = "stream ended without [DONE]"
            r.success()  # the stream's outcome is reported below, as one SSE row
        _report("SSE", "completion stream", started, texts, error)
