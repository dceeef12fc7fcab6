"""Adapter aliases through the gateway: weighted draws, an instant rollout and rollback, the job record
and metrics naming the adapter that served, isolation as for adapters, and bad input as 4xx."""

from __future__ import annotations

import asyncio

import pytest

from shared import keys
from shared.errors import LorafleetError
from shared.tenants import SHARED_OWNER
from tests.gateway.fleet import ADMIN, next_queued_job, play_worker, submit


async def set_alias(client, name: str, tenant: str, **weights: int):
    versions = [{"adapter": adapter.replace("_", "-"), "weight": w} for adapter, w in weights.items()]
    return await client.put(f"/v1/admin/aliases/{name}", json={"tenant": tenant, "versions": versions}, headers=ADMIN)


async def drawn(client, fleet, count: int, alias: str = "acme-bot", tenant: str = "acme") -> list[str]:
    """The adapters `count` jobs naming `alias` were given, as their records say."""
    adapters = []
    for _ in range(count):
        job = await submit(client, fleet, tenant, adapter=alias)
        record = await (await client.get(f"/v1/jobs/{job['id']}", headers=fleet.auth(tenant))).json()
        assert record["alias"] == alias
        adapters.append(record["adapter"])
    return adapters


async def test_an_alias_draws_by_its_weights_and_a_new_weight_holds_for_the_next_job(admin_client, fleet, aredis):
    await fleet.add_adapter("acme-support-v2", "acme", "tiny")
    assert (await set_alias(admin_client, "acme-bot", "acme", acme_support=100, acme_support_v2=0)).status == 200

    assert await drawn(admin_client, fleet, 4) == ["acme-support"] * 4
    message = await next_queued_job(aredis)
    assert message.adapter.name == "acme-support"  # the worker runs the adapter drawn, not the alias

    await set_alias(admin_client, "acme-bot", "acme", acme_support=0, acme_support_v2=100)  # the rollout
    job = await submit(admin_client, fleet, "acme", adapter="acme-bot")
    record = await (await admin_client.get(f"/v1/jobs/{job['id']}", headers=fleet.auth("acme"))).json()
    assert (record["adapter"], record["adapter_version"], record["alias"]) == ("acme-support-v2", 1, "acme-bot")

    await set_alias(admin_client, "acme-bot", "acme", acme_support=50, acme_support_v2=50)  # a canary
    assert set(await drawn(admin_client, fleet, 24)) == {"acme-support", "acme-support-v2"}  # 2 × 2⁻²⁴ to fail
    await set_alias(admin_client, "acme-bot", "acme", acme_support=1, acme_support_v2=0)  # the rollback
    assert await drawn(admin_client, fleet, 3) == ["acme-support"] * 3

    metrics = await (await admin_client.get("/metrics")).text()
    assert 'lorafleet_gateway_alias_jobs_total{adapter="acme-support-v2",alias="acme-bot"}' in metrics


async def test_an_alias_is_used_only_by_its_owner_and_names_only_adapters_its_owner_may_use(admin_client, fleet):
    assert (await set_alias(admin_client, "acme-bot", "acme", acme_support=1)).status == 200
    response = await admin_client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hi", "adapter": "acme-bot"}, headers=fleet.auth("globex")
    )
    assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"

    for name, tenant, adapter in (("x", "acme", "globex-legal"), ("y", SHARED_OWNER, "acme-support")):
        response = await set_alias(admin_client, name, tenant, **{adapter.replace("-", "_"): 1})
        assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"

    assert (await set_alias(admin_client, "chat", SHARED_OWNER, shared_chat=1)).status == 200
    assert await drawn(admin_client, fleet, 1, alias="chat", tenant="globex") == ["shared-chat"]
    assert await drawn(admin_client, fleet, 1, alias="chat", tenant="acme") == ["shared-chat"]
    for tenant, listed in (("acme", {"acme-bot", "chat"}), ("globex", {"chat"})):
        models = await (await admin_client.get("/v1/models", headers=fleet.auth(tenant))).json()
        assert {m["id"] for m in models["data"]} & {"acme-bot", "chat"} == listed


async def test_alias_and_adapter_names_never_collide(admin_client, fleet):
    response = await set_alias(admin_client, "acme-support", "acme", acme_support=1)
    assert response.status == 409 and (await response.json())["error"]["code"] == "conflict"
    assert (await set_alias(admin_client, "acme-bot", "acme", acme_support=1)).status == 200
    with pytest.raises(LorafleetError) as refused:
        await fleet.add_adapter("acme-bot", "acme", "tiny")
    assert refused.value.code == "conflict"
    response = await set_alias(admin_client, "acme-bot", "globex", globex_legal=1)  # another tenant's alias
    assert response.status == 409


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"tenant": "acme", "versions": [{"adapter": "acme-support", "weight": 0}]}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": [{"adapter": "acme-support", "weight": "95"}]}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": [{"adapter": "acme-support", "weight": True}]}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": [{"adapter": "acme-support", "weight": -1}]}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": [{"adapter": "acme-support"}]}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": [{"adapter": 7, "weight": 1}]}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": "acme-support"}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": []}, 400, "invalid_request"),
        ({"tenant": "acme", "versions": [{"adapter": "acme-support", "weight": 1}] * 2}, 400, "invalid_request"),
        (
            {
                "tenant": "acme",
                "versions": [{"adapter": "acme-support", "weight": 1}, {"adapter": "acme-other", "weight": 1}],
            },
            400,
            "invalid_request",
        ),  # two base models
        ({"tenant": "acme", "versions": [{"adapter": "acme-support", "weight": 1}], "x": 1}, 400, "invalid_request"),
        ({"tenant": "nobody", "versions": [{"adapter": "acme-support", "weight": 1}]}, 404, "tenant_not_found"),
    ],
)
async def test_bad_alias_input_is_a_4xx_with_a_code(admin_client, fleet, body, status, code):
    response = await admin_client.put("/v1/admin/aliases/acme-bot", json=body, headers=ADMIN)
    assert response.status == status and (await response.json())["error"]["code"] == code
    response = await admin_client.put("/v1/admin/aliases/not:a name", json=body, headers=ADMIN)
    assert 400 <= response.status < 500


async def test_a_deleted_alias_is_not_found_and_aliases_are_listed_for_the_admin_only(admin_client, fleet, aredis):
    await set_alias(admin_client, "acme-bot", "acme", acme_support=3)
    listed = await (await admin_client.get("/v1/admin/aliases", headers=ADMIN)).json()
    assert [(a["name"], a["base_model"], a["versions"]) for a in listed["data"]] == [
        ("acme-bot", "tiny", [{"adapter": "acme-support", "weight": 3}])
    ]
    assert (await admin_client.get("/v1/admin/aliases", headers=fleet.auth("acme"))).status == 403

    assert (await admin_client.delete("/v1/admin/aliases/acme-bot", headers=ADMIN)).status == 200
    assert not await aredis.exists(keys.alias("acme-bot"))
    response = await admin_client.delete("/v1/admin/aliases/acme-bot", headers=ADMIN)
    assert response.status == 404
    response = await admin_client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hi", "adapter": "acme-bot"}, headers=fleet.auth("acme")
    )
    assert response.status == 404 and (await response.json())["error"]["code"] == "adapter_not_found"


async def test_an_adapter_an_alias_names_is_not_unregistered_until_the_alias_lets_it_go(admin_client, fleet):
    await fleet.add_adapter("acme-support-v2", "acme", "tiny")
    await set_alias(admin_client, "acme-bot", "acme", acme_support=1, acme_support_v2=1)
    response = await admin_client.delete("/v1/admin/adapters/acme-support", headers=ADMIN)
    assert response.status == 409 and "acme-bot" in (await response.json())["error"]["message"]

    await set_alias(admin_client, "acme-bot", "acme", acme_support_v2=1)  # acme-support taken out
    assert (await admin_client.delete("/v1/admin/adapters/acme-support", headers=ADMIN)).status == 200
    response = await admin_client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "acme-support-v2"}, headers=fleet.auth("acme")
    )
    assert response.status == 409
    await admin_client.delete("/v1/admin/aliases/acme-bot", headers=ADMIN)
    assert (await admin_client.delete("/v1/admin/adapters/acme-support-v2", headers=ADMIN)).status == 200


async def test_an_alias_is_an_openai_model_name_as_an_adapter_is(admin_client, fleet):
    await set_alias(admin_client, "acme-bot", "acme", acme_support=1)
    for model in ("acme-bot", "tiny:acme-bot"):
        request = asyncio.create_task(
            admin_client.post("/v1/completions", json={"model": model, "prompt": "hello"}, headers=fleet.auth("acme"))
        )
        message = await next_queued_job(fleet.redis)
        assert (message.model, message.adapter.name) == ("tiny", "acme-support")
        await play_worker(fleet.redis, message, [], "x")
        assert (await (await request).json())["model"] == model
    response = await admin_client.post(
        "/v1/completions", json={"model": "acme-bot", "prompt": "hello"}, headers=fleet.auth("globex")
    )
    assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
