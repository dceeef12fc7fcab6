"""Provisioning the demo in Redis: tenants with working keys, their adapters registered, demo.json
written; a restart reuses what Redis still has and re-issues only what it lost."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
from redis.asyncio import Redis

from cli.demo import provision_demo
from cli.demo_adapters import DEMO_ADAPTERS
from shared import keys
from shared.adapter_registry import get_adapter, list_adapters
from shared.errors import ErrorCode, LorafleetError
from shared.tenants import authenticate
from tests.cli.conftest import DemoFiles


@pytest.fixture
def state_dir(tmp_path: Path, demo_files: DemoFiles) -> Path:
    """A fresh state dir (no demo.json yet) whose adapters are the session's demo adapters."""
    shutil.copytree(demo_files.adapter_root, tmp_path / "adapters")
    return tmp_path


async def provision(aredis: Redis, state_dir: Path, demo_files: DemoFiles):
    return await provision_demo(aredis, state_dir, state_dir / "adapters", demo_files.model)


async def test_provision_creates_each_tenant_with_a_working_key_and_its_adapter(
    aredis: Redis, state_dir: Path, demo_files: DemoFiles
) -> None:
    tenants = await provision(aredis, state_dir, demo_files)

    assert [t.tenant for t in tenants] == [a.tenant for a in DEMO_ADAPTERS]
    for tenant, adapter in zip(tenants, DEMO_ADAPTERS, strict=True):
        assert (await authenticate(aredis, tenant.api_key)).tenant_id == tenant.tenant
        assert tenant.adapters == [adapter.name]
        record = await get_adapter(aredis, adapter.name)
        assert (record.tenant, record.base_model, record.path, record.rank) == (
            adapter.tenant,
            "demo",
            adapter.path("demo"),
            adapter.rank,
        )
        assert [r.name for r in await list_adapters(aredis, visible_to=tenant.tenant)] == [adapter.name]


async def test_demo_json_lists_tenants_keys_adapters_and_models_readable_by_the_owner_only(
    aredis: Redis, state_dir: Path, demo_files: DemoFiles
) -> None:
    tenants = await provision(aredis, state_dir, demo_files)

    demo = json.loads((state_dir / "demo.json").read_text())
    assert demo == {
        "tenants": [{"tenant": t.tenant, "api_key": t.api_key, "adapters": t.adapters} for t in tenants],
        "models": ["demo"],
    }
    assert stat.S_IMODE((state_dir / "demo.json").stat().st_mode) == 0o600


async def test_a_restart_reuses_keys_and_does_not_register_new_adapter_versions(
    aredis: Redis, state_dir: Path, demo_files: DemoFiles
) -> None:
    first = await provision(aredis, state_dir, demo_files)
    second = await provision(aredis, state_dir, demo_files)

    assert [t.api_key for t in second] == [t.api_key for t in first]
    for adapter in DEMO_ADAPTERS:
        assert (await get_adapter(aredis, adapter.name)).version == 1


async def test_keys_are_reissued_when_redis_lost_everything(
    aredis: Redis, state_dir: Path, demo_files: DemoFiles
) -> None:
    first = await provision(aredis, state_dir, demo_files)
    await aredis.flushall()
    second = await provision(aredis, state_dir, demo_files)

    for old, new in zip(first, second, strict=True):
        assert new.api_key != old.api_key
        assert (await authenticate(aredis, new.api_key)).tenant_id == new.tenant
    saved = json.loads((state_dir / "demo.json").read_text())
    assert [t["api_key"] for t in saved["tenants"]] == [t.api_key for t in second]


async def test_a_tenant_whose_saved_key_no_longer_works_gets_a_new_one_and_the_old_one_stays_dead(
    aredis: Redis, state_dir: Path, demo_files: DemoFiles
) -> None:
    first = await provision(aredis, state_dir, demo_files)
    lookup = first[0].api_key.split("_")[1]
    await aredis.delete(keys.api_key(lookup))  # Redis kept the tenant but lost its key
    second = await provision(aredis, state_dir, demo_files)

    assert second[0].api_key != first[0].api_key
    assert (await authenticate(aredis, second[0].api_key)).tenant_id == first[0].tenant
    with pytest.raises(LorafleetError) as refused:
        await authenticate(aredis, first[0].api_key)
    assert refused.value.code == ErrorCode.INVALID_API_KEY
    assert [t.api_key for t in second[1:]] == [t.api_key for t in first[1:]]
