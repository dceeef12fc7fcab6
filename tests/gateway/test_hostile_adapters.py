"""Hostile adapters against the gateway's registration routes (tenant `load_lora_adapter` and the admin
API), backed by a real Redis: every case of tests/shared/hostile_adapters.py is a 4xx with its own
code (never a 5xx), nothing is registered, and the gateway goes on serving. A tenant reaches only
its own directory of the adapter root; another tenant's path looks the same whether it exists or not."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient

from shared import keys
from shared.tenants import issue_key
from tests.gateway.fleet import Fleet, submit
from tests.shared.hostile_adapters import ALL_CASES, EQUIVALENT_PATHS, OTHER, OWNER, PATH_CASES, Hostile, Lab

ADMIN_KEY = "admin-secret-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
STATUS = {"adapter_path_forbidden": 403, "adapter_path_not_found": 404}  # every other code of the corpus: 400


@pytest.fixture
async def lab(fleet: Fleet, tmp_path) -> Lab:
    return Lab(fleet.adapter_root, tmp_path / "outside", fleet.models["tiny"])


@pytest.fixture
def gateway(admin_client: TestClient) -> TestClient:
    """The admin-enabled gateway of tests/gateway/conftest.py: these tests use both its routes."""
    return admin_client


async def load(gateway: TestClient, fleet: Fleet, name: str, path: str, tenant: str = OWNER):
    body = {"lora_name": name, "lora_path": path, "base_model_name": "tiny"}
    return await gateway.post("/v1/load_lora_adapter", json=body, headers=fleet.auth(tenant))


async def refusals(gateway: TestClient, lab: Lab, cases: list[Hostile], send) -> list[str]:
    """Send every case; the mismatches with what it must get (empty when all were refused right)."""
    wrong = []
    for i, case in enumerate(cases):
        response = await send(f"hostile-{i}", case.build(lab))
        body = await response.json() if response.content_type == "application/json" else {}
        code = body.get("error", {}).get("code")
        if (response.status, code) != (STATUS.get(case.code, 400), case.code):
            wrong.append(f"{case.name}: {response.status} {code} {body.get('error', {}).get('message', '')[:200]}")
    return wrong


async def test_every_hostile_adapter_is_refused_by_load_lora_adapter_and_the_gateway_serves_on(
    gateway: TestClient, fleet: Fleet, lab: Lab
):
    wrong = await refusals(gateway, lab, ALL_CASES, lambda name, path: load(gateway, fleet, name, path))

    assert not wrong, "\n".join(wrong)
    assert not [name async for name in fleet.redis.scan_iter(keys.adapter("hostile-*"))]
    response = await load(gateway, fleet, "good", lab.rel(lab.valid()))
    assert response.status == 200, await response.text()
    assert (await submit(gateway, fleet, adapter="good"))["status"] == "queued"


async def test_every_hostile_adapter_is_refused_by_the_admin_api(gateway: TestClient, fleet: Fleet, lab: Lab):
    async def register(name: str, path: str):
        body = {"name": name, "tenant": OWNER, "path": path, "model": "tiny"}
        return await gateway.post("/v1/admin/adapters", json=body, headers=ADMIN)

    wrong = await refusals(gateway, lab, ALL_CASES, register)

    assert not wrong, "\n".join(wrong)
    assert (await register("good", lab.rel(lab.valid()))).status == 201


async def test_a_tenant_cannot_serve_another_tenants_adapter_under_a_name_of_its_own(
    gateway: TestClient, fleet: Fleet, lab: Lab
):
    theirs = lab.rel(lab.valid(OTHER))
    for form in EQUIVALENT_PATHS:
        response = await load(gateway, fleet, "stolen", form(theirs, lab.root))
        assert response.status == 403, (form(theirs, lab.root), await response.text())
        assert (await response.json())["error"]["code"] == "adapter_path_forbidden"
    response = await gateway.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "adapter": "stolen"}, headers=fleet.auth(OWNER)
    )
    assert response.status == 404
    assert (await load(gateway, fleet, "theirs", theirs, tenant=OTHER)).status == 200  # its owner may


async def test_another_tenants_path_gets_the_same_answer_whether_or_not_it_exists(
    gateway: TestClient, fleet: Fleet, lab: Lab
):
    existing = lab.rel(lab.valid(OTHER, "legal"))
    missing = f"{OTHER}/nothing"
    for spell in (lambda p: p, lambda p: str(lab.root / p), lambda p: f"./{p}/"):
        answers = []
        for path in (spell(existing), spell(missing)):
            response = await load(gateway, fleet, "probe", path)
            answers.append((response.status, (await response.json())["error"]["message"].replace(path, "PATH")))
        assert answers[0] == answers[1], answers


@pytest.mark.parametrize("form", range(len(EQUIVALENT_PATHS)))
async def test_an_own_adapter_loads_by_any_spelling_of_its_path_and_is_stored_normalised(
    gateway: TestClient, fleet: Fleet, lab: Lab, form: int
):
    relative = lab.rel(lab.valid(name="ünïcode-adapter"))
    response = await load(gateway, fleet, "mine", EQUIVALENT_PATHS[form](relative, lab.root))
    assert response.status == 200, await response.text()
    listed = await (await gateway.get("/v1/admin/adapters", headers=ADMIN)).json()
    assert {a["name"]: a["path"] for a in listed["data"]}["mine"] == relative


async def test_an_adapter_swapped_for_a_symlink_after_registration_is_refused_at_the_next_load(
    gateway: TestClient, fleet: Fleet, lab: Lab
):
    directory = lab.valid()
    assert (await load(gateway, fleet, "swap", lab.rel(directory))).status == 200
    theirs = lab.valid(OTHER)
    (directory / "adapter_model.safetensors").unlink()
    (directory / "adapter_model.safetensors").symlink_to(theirs / "adapter_model.safetensors")

    response = await load(gateway, fleet, "swap", lab.rel(directory))
    assert response.status == 400 and (await response.json())["error"]["code"] == "adapter_symlink"


async def test_shared_is_no_tenant_name_and_a_tenant_called_so_before_is_refused(
    gateway: TestClient, fleet: Fleet, lab: Lab
):
    response = await gateway.post("/v1/admin/tenants", json={"name": "shared"}, headers=ADMIN)
    assert response.status == 400 and (await response.json())["error"]["code"] == "tenant_name_reserved"
    # one created before the name was reserved (straight into Redis) gets nothing done with its key
    await fleet.redis.sadd(keys.TENANTS, "shared")
    key = await issue_key(fleet.redis, "shared")
    headers = {"Authorization": f"Bearer {key}"}
    shared_adapter = lab.rel(lab.valid("shared"))
    body = {"lora_name": "shared-chat", "lora_path": shared_adapter, "base_model_name": "tiny"}
    for path, payload in (
        ("/v1/load_lora_adapter", body),
        ("/v1/unload_lora_adapter", {"lora_name": "shared-chat"}),
        ("/v1/jobs", {"model": "tiny", "prompt": "hello"}),
    ):
        response = await gateway.post(path, json=payload, headers=headers)
        assert response.status == 403 and (await response.json())["error"]["code"] == "forbidden", path
    assert await fleet.redis.exists(keys.adapter("shared-chat"))  # still there for everyone


@pytest.mark.parametrize("case", PATH_CASES[:8], ids=lambda c: c.name)
async def test_a_bad_path_never_touches_the_registry(gateway: TestClient, fleet: Fleet, lab: Lab, case: Hostile):
    before = await fleet.redis.smembers(keys.ADAPTERS)
    response = await load(gateway, fleet, "acme-support", case.build(lab))  # an existing name: not re-versioned
    assert 400 <= response.status < 500
    assert await fleet.redis.smembers(keys.ADAPTERS) == before
    assert fleet.adapters["acme-support"].version == 1
