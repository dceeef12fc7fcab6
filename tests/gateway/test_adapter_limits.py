"""Adapters over what a model's workers can serve (the rank of their LoRA slots, the projections they
have slots for), as the workers publish it in the model's record, are refused by the gateway with 400
adapter_exceeds_model_limits: at registration (the tenant route and the admin API) and at submit, for
one registered before the workers changed. Limits of workers that stopped serving the model are not
held against it; those of every live one are."""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.app import create_app
from shared import keys
from shared.config import GatewayConfig
from shared.model_info import PROJECTIONS
from shared.model_registry import AdapterLimits, adapter_limits, forget_worker, mark_served
from shared.tenants import hash_admin_key
from tests.gateway.fleet import LIMITS, Fleet, submit, write_adapter

ADMIN_KEY = "admin-secret-for-limits"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ANY_PROJECTION = AdapterLimits(max_rank=8, target_modules=PROJECTIONS)


@pytest.fixture
async def gateway(aiohttp_client: Any, redis_url: str, fleet: Fleet) -> TestClient:
    config = GatewayConfig(
        redis_url=redis_url, limits=LIMITS, admin_key_sha256=hash_admin_key(ADMIN_KEY), adapter_root=fleet.adapter_root
    )
    return await aiohttp_client(create_app(config))


async def serve(fleet: Fleet, worker: str, limits: AdapterLimits, *, model: str = "tiny", age_s: float = 0) -> None:
    """Publish `limits` as worker `worker`'s for `model`, as its heartbeat does, `age_s` seconds ago."""
    async with fleet.redis.pipeline(transaction=True) as pipe:
        mark_served(pipe, model, int((time.time() - age_s) * 1000), worker_id=worker, limits=limits)
        await pipe.execute()


async def error_of(response: Any) -> dict[str, Any]:
    assert response.status == 400, await response.text()
    return (await response.json())["error"]


async def test_a_tenant_cannot_load_an_adapter_of_a_rank_the_workers_lack(gateway: TestClient, fleet: Fleet):
    await serve(fleet, "w1", AdapterLimits(max_rank=1, target_modules=PROJECTIONS))  # the fleet's adapters: rank 2
    path = write_adapter(fleet.adapter_root, "acme/rank2", fleet.models["tiny"], seed=7)

    body = {"lora_name": "acme-rank2", "lora_path": path, "base_model_name": "tiny"}
    error = await error_of(await gateway.post("/v1/load_lora_adapter", json=body, headers=fleet.auth("acme")))

    assert error["code"] == "adapter_exceeds_model_limits"
    assert "needs LoRA slots of rank 2; the model's workers have rank 1 (--max-lora-rank)" in error["message"]
    assert await fleet.redis.hget(keys.adapter("acme-rank2"), "record") is None  # nothing registered


async def test_the_admin_api_cannot_register_an_adapter_on_projections_the_workers_have_no_slots_for(
    gateway: TestClient, fleet: Fleet
):
    await serve(fleet, "w1", AdapterLimits(max_rank=8, target_modules=("k_proj", "v_proj")))  # no q_proj slots
    path = write_adapter(fleet.adapter_root, "globex/q", fleet.models["tiny"], seed=8)  # targets q_proj

    body = {"name": "globex-q", "tenant": "globex", "path": path, "model": "tiny"}
    error = await error_of(await gateway.post("/v1/admin/adapters", json=body, headers=ADMIN))

    assert error["code"] == "adapter_exceeds_model_limits"
    assert "targets q_proj, for which the model's workers have no LoRA slots" in error["message"]


async def test_a_job_on_an_adapter_registered_before_the_workers_changed_is_refused_at_submit(
    gateway: TestClient, fleet: Fleet
):
    # acme-support (rank 2) was registered when no worker had said anything; then w2 joined w1
    await serve(fleet, "w1", ANY_PROJECTION)
    await serve(fleet, "w2", AdapterLimits(max_rank=1, target_modules=PROJECTIONS))  # jobs may reach it too

    body = {"model": "tiny", "adapter": "acme-support", "prompt": "hello"}
    error = await error_of(await gateway.post("/v1/jobs", json=body, headers=fleet.auth("acme")))

    assert error["code"] == "adapter_exceeds_model_limits" and error["param"] == "adapter"
    assert "adapter 'acme-support' needs LoRA slots of rank 2" in error["message"]
    assert (await submit(gateway, fleet, "acme"))["status"] == "queued"  # base-model jobs go on


async def test_limits_of_workers_that_stopped_serving_the_model_do_not_count(fleet: Fleet):
    await serve(fleet, "gone", AdapterLimits(max_rank=1, target_modules=()), age_s=600)  # silent for 10 minutes
    await serve(fleet, "live", ANY_PROJECTION)
    await serve(fleet, "stopped", AdapterLimits(max_rank=1, target_modules=()))
    async with fleet.redis.pipeline(transaction=True) as pipe:
        forget_worker(pipe, "tiny", "stopped")  # as a worker does when it stops
        await pipe.execute()

    since_ms = time.time() * 1000 - 120_000
    assert await adapter_limits(fleet.redis, "tiny", since_ms=since_ms) == ANY_PROJECTION
    assert await adapter_limits(fleet.redis, "other", since_ms=since_ms) is None  # no worker said anything


def test_the_strictest_limits_are_what_every_worker_allows():
    limits = [
        AdapterLimits(max_rank=64, target_modules=("q_proj", "k_proj", "v_proj")),
        AdapterLimits(max_rank=16, target_modules=("q_proj", "v_proj", "o_proj")),
    ]
    assert AdapterLimits.strictest(limits) == AdapterLimits(max_rank=16, target_modules=("q_proj", "v_proj"))
    assert AdapterLimits.strictest([]) is None


async def test_a_model_served_by_a_worker_without_lora_refuses_adapter_jobs_and_says_so_in_v1_models(
    gateway: TestClient, fleet: Fleet
):
    await serve(fleet, "w1", ANY_PROJECTION)
    await serve(fleet, "w2", AdapterLimits(max_rank=0, target_modules=()))  # started with --max-loras 0

    body = {"model": "tiny", "adapter": "acme-support", "prompt": "hello"}
    error = await error_of(await gateway.post("/v1/jobs", json=body, headers=fleet.auth("acme")))

    assert error["code"] == "adapter_exceeds_model_limits" and error["param"] == "adapter"
    assert "a worker serving the model runs without LoRA (--max-loras 0)" in error["message"]
    assert (await submit(gateway, fleet, "acme"))["status"] == "queued"  # base-model jobs go on
    models = (await (await gateway.get("/v1/models", headers=fleet.auth("acme"))).json())["data"]
    ranks = {m["id"]: m["max_lora_rank"] for m in models if "max_lora_rank" in m}
    assert ranks == {"tiny": 0, "other": None}  # no worker serves "other" now
