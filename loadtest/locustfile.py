"""Load test for a running lorafleet stack (Locust).

Users submit async jobs and long-poll them to completion, as the job API's clients do. Tenants
and adapters come from a `lorafleet up` state dir's demo.json (or LORAFLEET_TENANTS_FILE with the
same shape); which tenant/adapter each job uses follows Zipf(alpha) over all (tenant, adapter)
pairs, so a few adapters are hot and most are cold, as in real multi-tenant traffic.

    pip install -e ".[load]"
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s --csv out/run

Settings (environment): LORAFLEET_STATE_DIR (default .lorafleet), LORAFLEET_ZIPF_ALPHA (1.0),
LORAFLEET_MAX_TOKENS (mean output tokens, 32), LORAFLEET_PROMPT_WORDS (mean prompt words, 24),
LORAFLEET_BASE_FRACTION (share of jobs without an adapter, 0.1).
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
BASE_FRACTION = float(os.environ.get("LORAFLEET_BASE_FRACTION", "0.1"))


class JobUser(HttpUser):
    """Submits a job, then long-polls it; reports the whole job as one "job" request in the stats."""

    wait_time = between(0.0, 0.5)

    @task
    def submit_and_wait(self) -> None:
        target = random.choices(TARGETS, weights=WEIGHTS)[0]
        words = max(1, int(random.expovariate(1 / MEAN_WORDS)))
        body = {
            "model": target.model,
            "prompt": " ".join(random.choices(_WORDS, k=words)),
            "max_tokens": max(1, int(random.expovariate(1 / MEAN_TOKENS))),
            "temperature": 0.8,
        }
        if target.adapter is not None and random.random() >= BASE_FRACTION:
            body["adapter"] = target.adapter
        headers = {"Authorization": f"Bearer {target.api_key}"}
        started = time.perf_counter()
        with self.client.post("/v1/jobs", json=body, headers=headers, name="POST /v1/jobs", catch_response=True) as r:
            if r.status_code != 202:
                r.failure(f"submit: {r.status_code} {r.text[:200]}")
                return
            job_id = r.json()["id"]
        status = "queued"
        while status in ("queued", "running"):
            with self.client.get(
                f"/v1/jobs/{job_id}?wait=30", headers=headers, name="GET /v1/jobs/{id}?wait", catch_response=True
            ) as r:
                if r.status_code != 200:
                    r.failure(f"poll: {r.status_code}")
                    return
                job = r.json()
                status = job["status"]
        elapsed_ms = (time.perf_counter() - started) * 1000
        events.request.fire(
            request_type="JOB",
            name=f"job {'adapter' if 'adapter' in body else 'base'}",
            response_time=elapsed_ms,
            response_length=job["usage"]["completion_tokens"] if status == "succeeded" else 0,
            exception=None if status == "succeeded" else RuntimeError(f"job {status}: {job.get('error')}"),
            context={},
        )
