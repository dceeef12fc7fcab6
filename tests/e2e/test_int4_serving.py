"""A worker serving a 4-bit model as a real process behind the gateway and Redis: the demo model
quantized at load (--quantization int4) and the same model saved as an AWQ checkpoint; jobs with
and without an adapter succeed, and the heartbeat and /v1/models say how the model is served.

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
from tests.fleet import MODEL, TENANT, Fleet, jobs_for, open_fleet, write_demo_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int4_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(plain model dir, its AWQ checkpoint dir, adapter root)."""
    root = tmp_path_factory.mktemp("int4_demo")
    model_dir, adapter_root = write_demo_assets(root, DemoModelShape(intermediate_size=768))
    return model_dir, save_int4_checkpoint(model_dir, root / "awq", method="awq"), adapter_root


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


@pytest.fixture(params=["int4", "awq"])
def int4_fleet(
    request: pytest.FixtureRequest, redis_url: str, int4_assets: tuple[Path, Path, Path], tmp_path: Path
) -> Iterator[tuple[Fleet, str]]:
    """A fleet over the plain model (to quantize at load: "int4") or its AWQ checkpoint ("awq")."""
    plain, awq, adapter_root = int4_assets
    with ExitStack() as stack:
        yield (
            open_fleet(redis_url, (plain if request.param == "int4" else awq, adapter_root), tmp_path, stack),
            request.param,
        )


def test_4bit_model_serves_jobs_and_reports_its_quantization(int4_fleet: tuple[Fleet, str]) -> None:
    fleet, served = int4_fleet
    fleet.start_gateway()
    fleet.start_worker("w1", *(["--quantization", "int4"] if served == "int4" else []))

    records = fleet.wait_finished(fleet.submit(jobs_for(4, max_tokens=6)), timeout_s=60)
    assert all(len(record.output.token_ids) == 6 for record in records), records

    heartbeat, model = reported_quantization(fleet)
    assert heartbeat == {MODEL: {"weights": served, "kv_cache": "auto"}}
    assert (model["quantization"], model["kv_cache_dtype"]) == (served, "auto")
