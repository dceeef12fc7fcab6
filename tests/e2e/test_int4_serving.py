"""A worker serving a 4-bit model as a real process behind the gateway and Redis: the demo model
quantized at load (--quantization int4, --quantization nf4) and the same model saved as an AWQ
checkpoint and as a bitsandbytes NF4 one (double-quantized, as QLoRA saves it); jobs with and
without an adapter succeed, and the heartbeat and /v1/models say how the model is served.

The demo model's MLP width (688) is no whole number of 4-bit groups, so these fleets serve it with
an MLP of 768 (six groups of 128); everything else is the demo model."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from cli.demo_model import DemoModelShape
from shared import keys
from tests.engine.int4_oracle import save_int4_checkpoint
from tests.engine.nf4_oracle import save_bnb_checkpoint
from tests.fleet import MODEL, TENANT, Fleet, jobs_for, open_fleet, write_demo_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int4_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Path]:
    """(model dir by how the fleet serves it, adapter root)."""
    root = tmp_path_factory.mktemp("int4_demo")
    model_dir, adapter_root = write_demo_assets(root, DemoModelShape(intermediate_size=768))
    models = {
        "int4": model_dir,
        "nf4-at-load": model_dir,
        "awq": save_int4_checkpoint(model_dir, root / "awq", method="awq"),
        "nf4": save_bnb_checkpoint(model_dir, root / "nf4", double_quant=True),
    }
    return models, adapter_root


def reported_quantization(fleet: Fleet) -> tuple[dict, dict]:
    """(the worker's heartbeat quantization field, the model's /v1/models entry)."""
    with fleet.redis() as client:
        heartbeat = json.loads(client.hget(keys.worker("w1"), "quantization"))
    request = urllib.request.Request(
        f"{fleet.url}/v1/models", headers={"Authorization": f"Bearer {fleet.api_keys[TENANT]}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        model = next(entry for entry in json.loads(response.read())["data"] if entry["id"] == MODEL)
    return heartbeat, model


@pytest.fixture(params=["int4", "awq", "nf4-at-load", "nf4"])
def int4_fleet(
    request: pytest.FixtureRequest, redis_url: str, int4_assets: tuple[dict[str, Path], Path], tmp_path: Path
) -> Iterator[tuple[Fleet, str]]:
    """A fleet over the plain model (to quantize at load: "int4", "nf4-at-load") or a published 4-bit
    checkpoint ("awq", "nf4")."""
    models, adapter_root = int4_assets
    with ExitStack() as stack:
        yield open_fleet(redis_url, (models[request.param], adapter_root), tmp_path, stack), request.param


# the worker's --quantization for each fleet, and what it reports serving
AT_LOAD = {"int4": ["--quantization", "int4"], "nf4-at-load": ["--quantization", "nf4"]}
REPORTED = {"int4": "int4", "awq": "awq", "nf4-at-load": "nf4", "nf4": "nf4"}


def test_4bit_model_serves_jobs_and_reports_its_quantization(int4_fleet: tuple[Fleet, str]) -> None:
    fleet, source = int4_fleet
    served = REPORTED[source]
    fleet.start_gateway()
    fleet.start_worker("w1", *AT_LOAD.get(source, []))

    records = fleet.wait_finished(fleet.submit(jobs_for(4, max_tokens=6)), timeout_s=60)
    assert all(len(record.output.token_ids) == 6 for record in records), records

    heartbeat, model = reported_quantization(fleet)
    assert heartbeat == {MODEL: {"weights": served, "unquantized_projections": [], "kv_cache": "auto"}}
    assert (model["quantization"], model["kv_cache_dtype"]) == (served, "auto")
