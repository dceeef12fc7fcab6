"""The admin API (admin key only) and vLLM-style load/unload (tenant-scoped)."""

from __future__ import annotations

import json

from shared import keys
from shared.adapter_digest import file_digest
from shared.adapter_format import WEIGHTS_FILE
from shared.adapter_registry import get_adapter, track_adapter_job, unregister_adapter
from tests.gateway.fleet import ADMIN, submit, write_adapter


async def test_admin_routes_refuse_tenants_and_missing_or_wrong_keys(admin_client, fleet):
    for headers, status, code in (
        ({}, 401, "missing_api_key"),
        ({"Authorization": "Bearer wrong"}, 403, "forbidden"),
        (fleet.auth("acme"), 403, "forbidden"),
    ):
        for method, path in (
            ("GET", "/v1/admin/tenants"),
            ("GET", "/v1/admin/adapters"),
            ("POST", "/v1/admin/tenants"),
        ):
            response = await admin_client.request(method, path, headers=headers, json={"name": "x"})
            assert response.status == status, (path, headers)
            assert (await response.json())["error"]["code"] == code


async def test_without_an_admin_key_the_admin_api_is_off(client, fleet):
    response = await client.get("/v1/admin/tenants", headers=ADMIN)
    assert response.status == 403 and (await response.json())["error"]["code"] == "admin_disabled"


async def test_tenant_lifecycle_create_list_rotate_disable(admin_client, fleet):
    created = await admin_client.post("/v1/admin/tenants", json={"name": "initech"}, headers=ADMIN)
    assert created.status == 201
    key = (await created.json())["api_key"]
    tenant_headers = {"Authorization": f"Bearer {key}"}
    assert (await admin_client.get("/v1/models", headers=tenant_headers)).status == 200
    listed = await (await admin_client.get("/v1/admin/tenants", headers=ADMIN)).json()
    assert {t["tenant"] for t in listed["data"]} == {"acme", "globex", "initech"}

    rotated = await (await admin_client.post("/v1/admin/tenants/initech/rotate-key", headers=ADMIN)).json()
    assert (await admin_client.get("/v1/models", headers=tenant_headers)).status == 401
    tenant_headers = {"Authorization": f"Bearer {rotated['api_key']}"}
    assert (await admin_client.get("/v1/models", headers=tenant_headers)).status == 200

    patched = await admin_client.patch("/v1/admin/tenants/initech", json={"disabled": True}, headers=ADMIN)
    assert (await patched.json())["disabled"] is True
    response = await admin_client.get("/v1/models", headers=tenant_headers)
    assert response.status == 403 and (await response.json())["error"]["code"] == "tenant_disabled"


async def test_tenant_admin_bad_input(admin_client, fleet):
    cases = [
        ("POST", "/v1/admin/tenants", {"name": "Bad Name!"}, 400, "invalid_request"),
        ("POST", "/v1/admin/tenants", {"name": "acme"}, 409, "conflict"),
        ("POST", "/v1/admin/tenants", {"nom": "x"}, 400, "invalid_request"),
        ("POST", "/v1/admin/tenants/nobody/rotate-key", None, 404, "tenant_not_found"),
        ("PATCH", "/v1/admin/tenants/nobody", {"disabled": True}, 404, "tenant_not_found"),
        ("PATCH", "/v1/admin/tenants/acme", {"limits": {"requests_per_min": 0}}, 400, "invalid_request"),
        ("PATCH", "/v1/admin/tenants/acme", {"limits": {"bananas": 1}}, 400, "invalid_request"),
    ]
    for method, path, body, status, code in cases:
        response = await admin_client.request(method, path, json=body, headers=ADMIN)
        assert response.status == status, (path, body, await response.text())
        assert (await response.json())["error"]["code"] == code


async def test_admin_registers_lists_and_unregisters_adapters(admin_client, fleet):
    path = write_adapter(fleet.adapter_root, "globex/new", fleet.models["tiny"], seed=3)
    body = {"name": "globex-new", "tenant": "globex", "path": path, "model": "tiny"}
    registered = await admin_client.post("/v1/admin/adapters", json=body, headers=ADMIN)
    assert registered.status == 201, await registered.text()
    record = await registered.json()
    assert record["tenant"] == "globex"
    assert record["digest"] == file_digest(fleet.adapter_root / path / WEIGHTS_FILE)  # what workers check
    listed = await (await admin_client.get("/v1/admin/adapters", headers=ADMIN)).json()
    assert "globex-new" in {a["name"] for a in listed["data"]}
    models = await (await admin_client.get("/v1/models", headers=fleet.auth("acme"))).json()
    assert "globex-new" not in {m["id"] for m in models["data"]}

    assert (await admin_client.delete("/v1/admin/adapters/globex-new", headers=ADMIN)).status == 200
    response = await admin_client.delete("/v1/admin/adapters/globex-new", headers=ADMIN)
    assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"


async def test_unregister_refuses_while_a_job_on_the_adapter_is_in_flight(admin_client, fleet):
    job = await submit(admin_client, fleet, "acme", adapter="acme-support")

    response = await admin_client.delete("/v1/admin/adapters/acme-support", headers=ADMIN)
    assert response.status == 409 and (await response.json())["error"]["code"] == "conflict"
    response = await admin_client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "acme-support"}, headers=fleet.auth("acme")
    )
    assert response.status == 409

    await admin_client.post(f"/v1/jobs/{job['id']}/cancel", headers=fleet.auth("acme"))
    assert (await admin_client.delete("/v1/admin/adapters/acme-support", headers=ADMIN)).status == 200
    response = await admin_client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hi", "adapter": "acme-support"}, headers=fleet.auth("acme")
    )
    assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"


async def test_a_job_tracked_after_its_adapter_was_unregistered_is_not_queued(aredis, fleet):
    await unregister_adapter(aredis, "globex-legal")
    assert not await track_adapter_job(aredis, "globex-legal", "job_late")
    assert await aredis.zcard(keys.adapter_jobs("globex-legal")) == 0


async def test_ended_jobs_are_swept_from_an_adapters_in_flight_set(admin_client, fleet, aredis):
    for _ in range(10):  # each submit samples the set and drops the jobs that have ended
        job = await submit(admin_client, fleet, "acme", adapter="acme-support")
        await admin_client.post(f"/v1/jobs/{job['id']}/cancel", headers=fleet.auth("acme"))
    assert await aredis.zcard(keys.adapter_jobs("acme-support")) <= 2


async def test_admin_adapter_bad_input(admin_client, fleet):
    path = write_adapter(fleet.adapter_root, "acme/ok", fleet.models["tiny"])
    theirs = write_adapter(fleet.adapter_root, "globex/ok", fleet.models["tiny"])
    big = write_adapter(fleet.adapter_root, "acme/big", fleet.models["tiny"], rank=16)  # over max_lora_rank 8
    cases = [
        ({"name": "x", "tenant": "nobody", "path": path, "model": "tiny"}, 404, "tenant_not_found"),
        ({"name": "x", "tenant": "acme", "path": "../../etc", "model": "tiny"}, 400, "adapter_path_outside_root"),
        ({"name": "x", "tenant": "acme", "path": path, "model": "missing"}, 404, "model_not_found"),
        ({"name": "x", "tenant": "acme", "path": path}, 400, "invalid_request"),  # two models served: name one
        ({"name": "acme-support", "tenant": "globex", "path": theirs, "model": "tiny"}, 409, "conflict"),
        ({"name": "x", "tenant": "globex", "path": path, "model": "tiny"}, 403, "adapter_path_forbidden"),
        ({"name": "x", "tenant": "shared", "path": path, "model": "tiny"}, 403, "adapter_path_forbidden"),
        ({"name": "x", "tenant": "acme", "path": big, "model": "tiny"}, 400, "adapter_rank_too_large"),
    ]
    for body, status, code in cases:
        response = await admin_client.post("/v1/admin/adapters", json=body, headers=ADMIN)
        assert response.status == status, (body, await response.text())
        assert (await response.json())["error"]["code"] == code


async def test_an_unknown_base_model_is_named_by_the_field_the_caller_sent(admin_client, fleet):
    path = write_adapter(fleet.adapter_root, "ok", fleet.models["tiny"])
    admin_body = {"name": "x", "tenant": "acme", "path": path, "model": "missing"}
    response = await admin_client.post("/v1/admin/adapters", json=admin_body, headers=ADMIN)
    assert (await response.json())["error"]["param"] == "model"
    response = await admin_client.post(
        "/v1/admin/adapters", json={"name": "x", "tenant": "acme", "path": path}, headers=ADMIN
    )
    assert (await response.json())["error"]["param"] == "model"  # two models served: name one

    vllm_body = {"lora_name": "x", "lora_path": path, "base_model_name": "missing"}
    response = await admin_client.post("/v1/load_lora_adapter", json=vllm_body, headers=fleet.auth("acme"))
    assert (await response.json())["error"]["param"] == "base_model_name"


async def test_load_and_unload_lora_adapter_are_tenant_scoped(admin_client, fleet):
    path = write_adapter(fleet.adapter_root, "acme/fresh", fleet.models["tiny"], seed=5)
    body = {"lora_name": "acme-fresh", "lora_path": path, "base_model_name": "tiny"}
    response = await admin_client.post("/v1/load_lora_adapter", json=body, headers=fleet.auth("acme"))
    assert response.status == 200 and "acme-fresh" in await response.text()
    acme_models = await (await admin_client.get("/v1/models", headers=fleet.auth("acme"))).json()
    globex_models = await (await admin_client.get("/v1/models", headers=fleet.auth("globex"))).json()
    assert "acme-fresh" in {m["id"] for m in acme_models["data"]}
    assert "acme-fresh" not in {m["id"] for m in globex_models["data"]}

    # globex can neither unload it, nor take over its name, nor serve its files under a name of its own
    response = await admin_client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "acme-fresh"}, headers=fleet.auth("globex")
    )
    assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"
    theirs = write_adapter(fleet.adapter_root, "globex/fresh", fleet.models["tiny"], seed=6)
    response = await admin_client.post(
        "/v1/load_lora_adapter", json={**body, "lora_path": theirs}, headers=fleet.auth("globex")
    )
    assert response.status == 409
    response = await admin_client.post(
        "/v1/load_lora_adapter", json={**body, "lora_name": "globex-copy"}, headers=fleet.auth("globex")
    )
    assert response.status == 403 and (await response.json())["error"]["code"] == "adapter_path_forbidden"
    response = await admin_client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "acme-fresh"}, headers=fleet.auth("acme")
    )
    assert response.status == 200
    response = await admin_client.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=fleet.auth("acme"))
    assert response.status == 400 and (await response.json())["error"]["param"] == "lora_path"
    response = await admin_client.post("/v1/load_lora_adapter", json=body)
    assert response.status == 401


async def test_a_record_registered_before_piece_digests_reads_back_naming_its_plain_sha256(admin_client, fleet, aredis):
    """Such a record's jobs fail on the worker asking for the adapter to be registered again
    (tests/worker/test_hostile_adapter_load.py); the registry and its listing read it as it is."""
    record = (await get_adapter(aredis, "acme-support")).to_dict()
    del record["digest"]
    record["sha256"] = "ab" * 32
    await aredis.hset(keys.adapter("acme-support"), "record", json.dumps(record))

    assert (await get_adapter(aredis, "acme-support")).digest == "sha256:" + "ab" * 32
    listed = await (await admin_client.get("/v1/admin/adapters", headers=ADMIN)).json()
    assert {a["name"]: a["digest"] for a in listed["data"]}["acme-support"] == "sha256:" + "ab" * 32
