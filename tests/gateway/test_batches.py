"""The Batch API over the gateway's driver: lines run as batch-class jobs (finished here as a worker
would, through the job store), the batch ends with output and error files keyed by custom_id."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.app import create_app
from gateway.batches import BatchRecord, BatchStore
from shared import keys
from shared.config import BatchConfig, GatewayConfig
from shared.schema import JobMessage, Priority
from tests.gateway.fleet import Fleet, next_queued_job, play_worker
from tests.gateway.test_files import form

LINES_IN_FLIGHT = 2


@pytest.fixture
def gateway_config(gateway_config: GatewayConfig) -> GatewayConfig:
    batches = BatchConfig(lines_in_flight=LINES_IN_FLIGHT, driver_interval_s=0.02)
    return replace(gateway_config, batches=batches)


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "hello world", "max_tokens": 4, **body}}  # fmt: skip


async def create_batch(client: TestClient, fleet: Fleet, lines: list[dict[str, Any]], tenant: str = "acme") -> dict:
    content = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    file = await (await client.post("/v1/files", data=form(content), headers=fleet.auth(tenant))).json()
    response = await client.post(
        "/v1/batches",
        json={"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h",
              "metadata": {"run": "nightly"}},
        headers=fleet.auth(tenant),
    )  # fmt: skip
    assert response.status == 200, await response.text()
    return await response.json()


async def batch_when(client: TestClient, fleet: Fleet, batch_id: str, *statuses: str) -> dict[str, Any]:
    for _ in range(500):
        batch = await (await client.get(f"/v1/batches/{batch_id}", headers=fleet.auth("acme"))).json()
        if batch["status"] in statuses:
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch still {batch['status']}")


async def file_lines(client: TestClient, fleet: Fleet, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    content = await (await client.get(f"/v1/files/{file_id}/content", headers=fleet.auth("acme"))).read()
    return {item["custom_id"]: item for item in map(json.loads, content.splitlines())}


async def run_line(fleet: Fleet, text: str = "jumps over") -> JobMessage:
    message = await next_queued_job(fleet.redis, priority=Priority.BATCH)
    await play_worker(fleet.redis, message, [text], text)
    return message


async def test_a_batch_runs_each_line_as_a_batch_job_and_an_invalid_line_fails_alone(
    client: TestClient, fleet: Fleet
) -> None:
    batch = await create_batch(client, fleet, [line("a"), line("b", max_tokens=10_000), line("c")])
    assert batch["status"] == "validating" and batch["metadata"] == {"run": "nightly"}

    messages = [await run_line(fleet), await run_line(fleet)]
    done = await batch_when(client, fleet, batch["id"], "completed")

    assert {m.priority for m in messages} == {Priority.BATCH} and {m.tenant for m in messages} == {"acme"}
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert all(done[stamp] for stamp in ("in_progress_at", "finalizing_at", "completed_at"))
    output = await file_lines(client, fleet, done["output_file_id"])
    errors = await file_lines(client, fleet, done["error_file_id"])
    assert set(output) == {"a", "c"} and set(errors) == {"b"}
    assert output["a"]["response"]["status_code"] == 200
    assert output["a"]["response"]["body"]["choices"][0]["text"] == "jumps over"
    assert errors["b"]["error"]["code"] == "invalid_request" and errors["b"]["response"]["status_code"] == 400


async def test_a_batch_keeps_at_most_its_lines_in_flight_queued(client: TestClient, fleet: Fleet) -> None:
    batch = await create_batch(client, fleet, [line(str(i)) for i in range(5)])

    for _ in range(5):
        await asyncio.sleep(0.1)  # several driver rounds
        assert await fleet.redis.xlen(keys.queue("tiny", Priority.BATCH)) <= LINES_IN_FLIGHT
        await run_line(fleet)
    done = await batch_when(client, fleet, batch["id"], "completed")
    assert set(await file_lines(client, fleet, done["output_file_id"])) == {"0", "1", "2", "3", "4"}


async def test_cancelling_a_batch_cancels_its_queued_lines_and_keeps_the_finished_ones(
    client: TestClient, fleet: Fleet
) -> None:
    batch = await create_batch(client, fleet, [line("a"), line("b"), line("c")])
    finished = await run_line(fleet)
    await batch_when(client, fleet, batch["id"], "in_progress")
    queued = await next_queued_job(fleet.redis, priority=Priority.BATCH)

    cancelling = await client.post(f"/v1/batches/{batch['id']}/cancel", headers=fleet.auth("acme"))
    assert (await cancelling.json())["status"] in ("cancelling", "cancelled")
    done = await batch_when(client, fleet, batch["id"], "cancelled")

    output = await file_lines(client, fleet, done["output_file_id"])
    assert set(output) == {"a"} and output["a"]["response"]["request_id"] == finished.job_id
    assert done["request_counts"]["completed"] == 1
    assert (await fleet.redis.hget(keys.job(queued.job_id), "status")) == b"canceled"


async def test_a_batch_past_its_window_expires_with_its_lines_not_done_as_errors(
    client: TestClient, fleet: Fleet
) -> None:
    batch = await create_batch(client, fleet, [line("a"), line("b"), line("c")])
    await run_line(fleet)
    await batch_when(client, fleet, batch["id"], "in_progress")
    await fleet.redis.hset(keys.batch(batch["id"]), "expires_ms", 1)

    done = await batch_when(client, fleet, batch["id"], "expired")

    errors = await file_lines(client, fleet, done["error_file_id"])
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert {item["error"]["code"] for item in errors.values()} == {"batch_expired"} and len(errors) == 2
    assert all(item["response"] is None for item in errors.values())  # never answered, as OpenAI writes them


async def test_another_tenants_batch_is_reported_as_missing(client: TestClient, fleet: Fleet) -> None:
    batch = await create_batch(client, fleet, [line("a")])

    for method, path in (("GET", ""), ("POST", "/cancel")):
        response = await client.request(method, f"/v1/batches/{batch['id']}{path}", headers=fleet.auth("globex"))
        assert response.status == 404 and (await response.json())["error"]["code"] == "batch_not_found"
    assert (await (await client.get("/v1/batches", headers=fleet.auth("globex"))).json())["data"] == []


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, 400, "endpoint"),
        ({"completion_window": "1h"}, 400, "completion_window"),
        ({"metadata": {"k": 7}}, 400, "metadata"),
        ({"input_file_id": "file-" + "0" * 24}, 404, "file_id"),
        ({"extra": 1}, 400, "extra"),
    ],
)
async def test_a_bad_batch_request_is_refused_naming_the_field(
    client: TestClient, fleet: Fleet, change: dict[str, Any], status: int, param: str
) -> None:
    file = await (await client.post("/v1/files", data=form(b'{"custom_id": "a"}\n'), headers=fleet.auth("acme"))).json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h", **change}

    response = await client.post("/v1/batches", json=body, headers=fleet.auth("acme"))

    assert response.status == status and (await response.json())["error"]["param"] == param


async def test_lines_that_ask_for_nonsense_fail_alone_and_the_batch_completes(client: TestClient, fleet: Fleet) -> None:
    odd = [
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
        {"custom_id": "url", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}},
        {"custom_id": "nobody", "method": "POST", "url": "/v1/completions", "body": [1]},
        line("dict-prompt", prompt={"a": 1}),
        line("model", model=7),
        line("no-model", model="nonexistent"),
        line("other-tenant", model="tiny:globex-legal"),
        line("stream", stream=True),
        line("huge", max_tokens=2**70),
    ]
    batch = await create_batch(client, fleet, [*odd, line("ok")])

    await run_line(fleet)
    done = await batch_when(client, fleet, batch["id"], "completed")

    errors = await file_lines(client, fleet, done["error_file_id"])
    assert set(errors) == {item["custom_id"] for item in odd}
    assert set(await file_lines(client, fleet, done["output_file_id"])) == {"ok"}

    assert errors["other-tenant"]["error"]["code"] == "adapter_not_found"  # another tenant's adapter: as if missing
    assert "internal_error" not in {item["error"]["code"] for item in errors.values()}


async def test_two_gateways_drive_one_batch_and_each_line_lands_once(
    client: TestClient, fleet: Fleet, aiohttp_client: Any, gateway_config: GatewayConfig
) -> None:
    await aiohttp_client(create_app(gateway_config))  # a second gateway, its driver on the same Redis
    batch = await create_batch(client, fleet, [line(str(i)) for i in range(6)])

    for _ in range(6):
        await run_line(fleet)
    done = await batch_when(client, fleet, batch["id"], "completed")

    content = await (await client.get(f"/v1/files/{done['output_file_id']}/content", headers=fleet.auth("acme"))).read()
    assert sorted(json.loads(text)["custom_id"] for text in content.splitlines()) == [str(i) for i in range(6)]


async def test_a_batch_whose_gateway_died_holding_its_lease_is_taken_over_once_the_lease_expires(
    client: TestClient, fleet: Fleet
) -> None:
    batch_id = "batch_" + "0" * 24
    await fleet.redis.set(keys.batch_lease(batch_id), "a-dead-gateway", px=300)
    content = json.dumps(line("a")).encode() + b"\n"
    file = await (await client.post("/v1/files", data=form(content), headers=fleet.auth("acme"))).json()
    record = BatchRecord(batch_id, "acme", "/v1/completions", file["id"], created_ms=1, expires_ms=2**50)
    await BatchStore(fleet.redis, ttl_s=60).create(record)

    await asyncio.sleep(0.2)
    assert (await (await client.get(f"/v1/batches/{batch_id}", headers=fleet.auth("acme"))).json())["status"] == (
        "validating"
    )  # the lease still holds it
    await run_line(fleet)
    assert (await batch_when(client, fleet, batch_id, "completed"))["request_counts"]["completed"] == 1


async def test_the_input_file_of_a_running_batch_cannot_be_deleted(client: TestClient, fleet: Fleet) -> None:
    batch = await create_batch(client, fleet, [line("a")])

    refused = await client.delete(f"/v1/files/{batch['input_file_id']}", headers=fleet.auth("acme"))
    assert refused.status == 409 and (await refused.json())["error"]["code"] == "conflict"
    await run_line(fleet)
    await batch_when(client, fleet, batch["id"], "completed")
    assert (await client.delete(f"/v1/files/{batch['input_file_id']}", headers=fleet.auth("acme"))).status == 200
