"""A worker started with a lower --max-lora-rank than an adapter's rank (or without LoRA, --max-loras 0)
publishes its limits, and the gateway refuses that adapter's jobs with 400 adapter_exceeds_model_limits
instead of queueing jobs the worker would fail; adapters within its limits (and the base model) are served."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from tests.fleet import MODEL, Fleet

pytestmark = pytest.mark.slow


def post_job(fleet: Fleet, tenant: str, adapter: str | None) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL, "adapter": adapter, "prompt": "Once upon a time", "max_tokens": 3}).encode()
    request = urllib.request.Request(
        f"{fleet.url}/v1/jobs",
        data=body,
        headers={"Authorization": f"Bearer {fleet.api_keys[tenant]}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_a_higher_rank_adapters_jobs_are_refused_for_a_worker_of_lower_max_lora_rank(fleet: Fleet):
    low, high = (next(a for a in DEMO_ADAPTERS if a.rank == rank) for rank in (8, 16))
    fleet.start_gateway()
    fleet.start_worker("w1", "--max-lora-rank", "8")

    status, body = post_job(fleet, high.tenant, high.name)
    assert status == 400, body
    assert body["error"]["code"] == "adapter_exceeds_model_limits"
    assert "rank 16" in body["error"]["message"] and "rank 8 (--max-lora-rank)" in body["error"]["message"]

    status, body = post_job(fleet, low.tenant, low.name)
    assert status == 202, body
    [record] = fleet.wait_finished([body["id"]], timeout_s=120)
    assert record.status.value == "succeeded", record.error


def test_a_worker_without_lora_serves_base_jobs_and_its_adapters_jobs_are_refused_at_submit(fleet: Fleet):
    adapter = DEMO_ADAPTERS[0]
    fleet.start_gateway()
    fleet.start_worker("w1", "--max-loras", "0")

    status, body = post_job(fleet, adapter.tenant, adapter.name)
    assert status == 400, body
    assert body["error"]["code"] == "adapter_exceeds_model_limits"
    assert "runs without LoRA (--max-loras 0)" in body["error"]["message"]

    status, body = post_job(fleet, adapter.tenant, None)  # the base model
    assert status == 202, body
    [record] = fleet.wait_finished([body["id"]], timeout_s=120)
    assert record.status.value == "succeeded", record.error
