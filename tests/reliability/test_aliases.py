"""An adapter alias through the running stack: a real worker serves each job with the adapter its
alias drew, a weight change holds for the next job (rollout, then rollback), with no worker restart."""

from __future__ import annotations

import asyncio

import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from shared.adapter_aliases import AliasVersion, set_alias
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.redis_client import plain_redis
from shared.schema import JobStatus
from tests.fleet import MODEL, TENANT, Fleet

pytestmark = pytest.mark.slow

STABLE = DEMO_ADAPTERS[0]  # the demo tenant's adapter
CANARY = "acme-support-canary"


def set_weights(fleet: Fleet, stable: int, canary: int) -> None:
    async def run() -> None:
        async with plain_redis(fleet.redis_url) as client:
            versions = [AliasVersion(STABLE.name, stable), AliasVersion(CANARY, canary)]
            await set_alias(client, "bot", TENANT, versions)

    asyncio.run(run())


def register_canary(fleet: Fleet) -> None:
    """The stable adapter's files under a second name: another adapter identity, as a new version is."""

    async def run() -> None:
        async with plain_redis(fleet.redis_url) as client:
            info = ModelInfo.from_pretrained(MODEL, fleet.model_dir)
            await register_adapter(
                client, name=CANARY, tenant=TENANT, model=info, adapter_root=fleet.adapter_root,
                path=STABLE.path(MODEL), max_rank=64, max_bytes=1 << 30,
            )  # fmt: skip

    asyncio.run(run())


def run_through_alias(fleet: Fleet, count: int) -> set[str]:
    job = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "adapter": "bot"}
    records = fleet.wait_finished(fleet.submit([job] * count), timeout_s=60)
    assert all(r.status is JobStatus.SUCCEEDED and r.alias == "bot" for r in records)
    return {r.adapter for r in records}


def test_a_canary_rolled_out_and_back_serves_the_next_jobs_without_a_restart(fleet: Fleet):
    fleet.start_gateway()
    fleet.start_worker("w1")
    register_canary(fleet)

    set_weights(fleet, stable=1, canary=0)
    assert run_through_alias(fleet, 2) == {STABLE.name}
    set_weights(fleet, stable=0, canary=1)  # the rollout
    assert run_through_alias(fleet, 2) == {CANARY}
    set_weights(fleet, stable=1, canary=0)  # the rollback
    assert run_through_alias(fleet, 2) == {STABLE.name}
