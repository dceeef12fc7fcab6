"""A worker serving the demo model with FP8 weights and an FP8 KV cache (--quantization fp8
--kv-cache-dtype fp8), and one serving it as a published mixed-precision FP8 checkpoint (q/k/v and
down left in the checkpoint's dtype by its ignore list), as real processes: jobs with and without an
adapter succeed, and the worker's heartbeat and the gateway's /v1/models say how the model is served."""

from __future__ import annotations

import json
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from shared import keys
from shared.model_info import decoder_projection_name
from tests.engine.fp8_oracle import save_fp8_checkpoint
from tests.fleet import MODEL, TENANT, Fleet, jobs_for, open_fleet, write_demo_assets

pytestmark = pytest.mark.slow


def test_fp8_model_serves_jobs_and_reports_its_quantization(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker("w1", "--quantization", "fp8", "--kv-cache-dtype", "fp8")

    records = fleet.wait_finished(fleet.submit(jobs_for(4, max_tokens=6)), timeout_s=60)
    assert all(len(record.output.token_ids) == 6 for record in records), records

    with fleet.redis() as client:
        reported = json.loads(client.hget(keys.worker("w1"), "quantization"))
    assert reported == {MODEL: {"weights": "fp8", "unquantized_projections": [], "kv_cache": "fp8"}}
    model = listed_model(fleet)
    assert (model["quantization"], model["kv_cache_dtype"]) == ("fp8", "fp8")


def test_a_mixed_precision_fp8_checkpoint_serves_jobs_and_reports_what_it_keeps(redis_url: str, tmp_path: Path) -> None:
    model_dir, adapter_root = write_demo_assets(tmp_path / "assets")
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    kept = tuple(decoder_projection_name(n, p) for n in range(layers) for p in ("q_proj", "k_proj", "v_proj"))
    kept += (decoder_projection_name(0, "down_proj"),)
    ignore = ["lm_head", r"re:.*self_attn\.[qkv]_proj$", decoder_projection_name(0, "down_proj")]
    mixed_dir = save_fp8_checkpoint(
        model_dir, tmp_path / "mixed", method="compressed-tensors", scales="channel",
        unquantized=kept, ignore={"ignore": ignore},
    )  # fmt: skip
    with ExitStack() as stack:
        fleet = open_fleet(redis_url, (mixed_dir, adapter_root), tmp_path, stack)
        fleet.start_gateway()
        fleet.start_worker("w1")

        records = fleet.wait_finished(fleet.submit(jobs_for(4, max_tokens=6)), timeout_s=60)
        assert all(len(record.output.token_ids) == 6 for record in records), records

        with fleet.redis() as client:
            reported = json.loads(client.hget(keys.worker("w1"), "quantization"))[MODEL]
        summary = [
            "model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj",
            "model.layers.0.mlp.down_proj",
        ]  # fmt: skip
        assert reported == {"weights": "fp8", "unquantized_projections": summary, "kv_cache": "auto"}
        model = listed_model(fleet)
        assert (model["quantization"], model["unquantized_projections"]) == ("fp8", summary)


def listed_model(fleet: Fleet) -> dict:
    """The model's entry in the gateway's /v1/models, as the demo tenant reads it."""
    request = urllib.request.Request(
        f"{fleet.url}/v1/models", headers={"Authorization": f"Bearer {fleet.api_keys[TENANT]}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return next(entry for entry in json.loads(response.read())["data"] if entry["id"] == MODEL)
