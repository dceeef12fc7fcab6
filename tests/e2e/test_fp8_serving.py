"""A worker serving the demo model with FP8 weights and an FP8 KV cache (--quantization fp8
--kv-cache-dtype fp8) as real processes: jobs with and without an adapter succeed, and the worker's
heartbeat and the gateway's /v1/models say how the model is served."""

from __future__ import annotations

import json
import urllib.request

import pytest

from shared import keys
from tests.fleet import MODEL, TENANT, Fleet, jobs_for

pytestmark = pytest.mark.slow


def test_fp8_model_serves_jobs_and_reports_its_quantization(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("w1", "--quantization", "fp8", "--kv-cache-dtype", "fp8")

    records = fleet.wait_finished(fleet.submit(jobs_for(4, max_tokens=6)), timeout_s=60)
    assert all(len(record.output.token_ids) == 6 for record in records), records

    with fleet.redis() as client:
        reported = json.loads(client.hget(keys.worker("w1"), "quantization"))
    assert reported == {MODEL: {"weights": "fp8", "unquantized_projections": [], "kv_cache": "fp8"}}
    request = urllib.request.Request(
        f"{fleet.url}/v1/models", headers={"Authorization": f"Bearer {fleet.api_keys[TENANT]}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        model = next(entry for entry in json.loads(response.read())["data"] if entry["id"] == MODEL)
    assert (model["quantization"], model["kv_cache_dtype"]) == ("fp8", "fp8")
