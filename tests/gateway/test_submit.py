"""POST /v1/jobs: what gets queued and recorded."""

from __future__ import annotations

import re
import time

from aiohttp.test_utils import TestClient
from structlog.testing import capture_logs

from gateway.job_ids import new_job_id
from shared import keys
from shared.schema import JobMessage, JobRecord, JobStatus, Priority, SamplingParams, decode_job
from tests.gateway.fleet import BOS_ID, Fleet, submit


async def queued_messages(
    fleet: Fleet, model: str = "tiny", priority: Priority = Priority.INTERACTIVE
) -> list[JobMessage]:
    return [decode_job(fields[b"job"]) for _, fields in await fleet.redis.xrange(keys.queue(model, priority))]


async def test_submit_returns_202_with_job_urls(client: TestClient, fleet: Fleet) -> None:
    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello world"}, headers=fleet.auth("acme")
    )

    assert response.status == 202
    body = await response.json()
    assert re.fullmatch(r"job_[0-9a-f]{32}", body["id"])
    assert body["status"] == "queued"
    assert body["urls"] == {"self": f"/v1/jobs/{body['id']}", "cancel": f"/v1/jobs/{body['id']}/cancel"}
    assert response.headers["Location"] == body["urls"]["self"]


async def test_submit_queues_the_tokenized_prompt_with_default_sampling(client: TestClient, fleet: Fleet) -> None:
    before_ms = int(time.time() * 1000)
    response = await client.post(
        "/v1/jobs",
        json={"model": "tiny", "prompt": "hello quick world"},
        headers={**fleet.auth("acme"), "X-Request-ID": "req-123"},
    )
    job_id = (await response.json())["id"]

    [message] = await queued_messages(fleet)
    assert message == JobMessage(
        job_id=job_id,
        tenant="acme",
        model="tiny",
        prompt_token_ids=tuple(fleet.tokenizer.encode("hello quick world").ids),
        sampling=SamplingParams(),
        adapter=None,
        created_at=message.created_at,
        deadline=None,
        request_id="req-123",
    )
    assert message.prompt_token_ids[0] == BOS_ID
    assert before_ms <= message.created_at * 1000 <= time.time() * 1000


async def test_submit_logs_one_access_line_with_the_request_and_the_job(client: TestClient, fleet: Fleet) -> None:
    with capture_logs() as logs:
        response = await client.post(
            "/v1/jobs",
            json={"model": "tiny", "prompt": "hello", "adapter": "acme-support"},
            headers={**fleet.auth("acme"), "X-Request-ID": "req-9"},
        )

    [line] = [entry for entry in logs if entry["event"] == "request"]
    assert line == {
        "event": "request",
        "log_level": "info",
        "method": "POST",
        "path": "/v1/jobs",
        "status": 202,
        "duration_ms": line["duration_ms"],
        "request_id": "req-9",
        "job_id": (await response.json())["id"],
        "tenant": "acme",
        "model": "tiny",
        "adapter": "acme-support",
    }
    assert line["duration_ms"] > 0


async def test_submit_writes_the_job_record(client: TestClient, fleet: Fleet) -> None:
    job_id = (await submit(client, fleet, adapter="acme-support", prompt="the quick brown fox"))["id"]

    record = JobRecord.from_hash(await fleet.redis.hgetall(keys.job(job_id)))
    [message] = await queued_messages(fleet)
    assert record.status is JobStatus.QUEUED
    assert (record.tenant, record.model, record.adapter) == ("acme", "tiny", "acme-support")
    assert record.prompt_tokens == 5  # <s> + four words
    assert record.created_ms == int(message.created_at * 1000)
    assert await fleet.redis.ttl(keys.job(job_id)) > 0


async def test_submit_passes_sampling_params_through(client: TestClient, fleet: Fleet) -> None:
    await submit(
        client,
        fleet,
        max_tokens=8,
        temperature=0,
        top_p=0.9,
        top_k=40,
        seed=2**64 - 1,
        stop=["dog", "fox"],
        ignore_eos=True,
    )

    [message] = await queued_messages(fleet)
    assert message.sampling == SamplingParams(
        max_tokens=8, temperature=0.0, top_p=0.9, top_k=40, seed=2**64 - 1, stop=("dog", "fox"), ignore_eos=True
    )


async def test_null_fields_take_their_defaults(client: TestClient, fleet: Fleet) -> None:
    await submit(client, fleet, adapter=None, max_tokens=None, temperature=None, seed=None, stop=None)

    [message] = await queued_messages(fleet)
    assert message.adapter is None
    assert message.sampling == SamplingParams()


async def test_single_stop_string_is_accepted(client: TestClient, fleet: Fleet) -> None:
    await submit(client, fleet, stop="dog")

    [message] = await queued_messages(fleet)
    assert message.sampling.stop == ("dog",)


async def test_token_id_prompt_is_queued_as_given(client: TestClient, fleet: Fleet) -> None:
    await submit(client, fleet, prompt=[3, 4, 12])

    [message] = await queued_messages(fleet)
    assert message.prompt_token_ids == (3, 4, 12)


async def test_adapter_job_carries_the_adapters_current_version(client: TestClient, fleet: Fleet) -> None:
    newer = await fleet.add_adapter("acme-support", "acme", "tiny", seed=1)
    assert newer.version == 2

    await submit(client, fleet, adapter="acme-support")

    [message] = await queued_messages(fleet)
    assert message.adapter == newer.ref()


async def test_shared_adapter_is_usable_by_every_tenant(client: TestClient, fleet: Fleet) -> None:
    await submit(client, fleet, "acme", adapter="shared-chat")
    await submit(client, fleet, "globex", adapter="shared-chat")

    messages = await queued_messages(fleet)
    assert [(m.tenant, m.adapter) for m in messages] == [
        ("acme", fleet.adapters["shared-chat"].ref()),
        ("globex", fleet.adapters["shared-chat"].ref()),
    ]


async def test_jobs_go_to_their_models_queue(client: TestClient, fleet: Fleet) -> None:
    await submit(client, fleet, model="other", adapter="acme-other")

    assert await fleet.redis.xlen(keys.queue("tiny")) == 0
    [message] = await queued_messages(fleet, "other")
    assert message.adapter == fleet.adapters["acme-other"].ref()


async def test_each_submit_gets_a_new_job_id(client: TestClient, fleet: Fleet) -> None:
    ids = {(await submit(client, fleet))["id"] for _ in range(3)}

    assert len(ids) == 3


def test_job_ids_are_distinct_across_reads_of_random_bytes() -> None:
    ids = [new_job_id() for _ in range(3 * 256)]  # three blocks' worth

    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"job_[0-9a-f]{32}", job_id) for job_id in ids)


async def test_repeated_idempotency_key_returns_the_same_job(client: TestClient, fleet: Fleet) -> None:
    headers = {**fleet.auth("acme"), "Idempotency-Key": "order-42"}
    job = {"model": "tiny", "prompt": "hello"}
    first = await client.post("/v1/jobs", json=job, headers=headers)
    second = await client.post("/v1/jobs", json=job, headers=headers)

    assert (first.status, second.status) == (202, 200)
    first_body, second_body = await first.json(), await second.json()
    assert second_body == first_body
    assert await fleet.redis.xlen(keys.queue("tiny")) == 1
    assert len(await fleet.redis.keys(keys.job("*"))) == 1


async def test_idempotency_keys_are_per_tenant(client: TestClient, fleet: Fleet) -> None:
    job = {"model": "tiny", "prompt": "hello"}
    acme = await client.post("/v1/jobs", json=job, headers={**fleet.auth("acme"), "Idempotency-Key": "k1"})
    globex = await client.post("/v1/jobs", json=job, headers={**fleet.auth("globex"), "Idempotency-Key": "k1"})

    assert (acme.status, globex.status) == (202, 202)
    assert (await acme.json())["id"] != (await globex.json())["id"]
    assert await fleet.redis.xlen(keys.queue("tiny")) == 2


async def test_generated_request_id_is_returned_and_queued(client: TestClient, fleet: Fleet) -> None:
    response = await client.post("/v1/jobs", json={"model": "tiny", "prompt": "hello"}, headers=fleet.auth("acme"))

    request_id = response.headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    [message] = await queued_messages(fleet)
    assert message.request_id == request_id


async def test_escaped_surrogate_pair_is_one_character(client: TestClient, fleet: Fleet) -> None:
    response = await client.post(
        "/v1/jobs", data=rb'{"model": "tiny", "prompt": "hello \ud83d\ude00"}', headers=fleet.auth("acme")
    )

    assert response.status == 202
    [message] = await queued_messages(fleet)
    assert message.prompt_token_ids == tuple(fleet.tokenizer.encode("hello \U0001f600").ids)


async def test_deadline_is_queued_as_an_absolute_time(client: TestClient, fleet: Fleet) -> None:
    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "deadline_s": 2.5}, headers=fleet.auth("acme")
    )
    assert response.status == 202

    [message] = await queued_messages(fleet)
    assert message.deadline == message.created_at + 2.5


async def test_deadline_out_of_range_is_refused(client: TestClient, fleet: Fleet) -> None:
    for bad in (0, -1, "soon", 10**9):
        response = await client.post(
            "/v1/jobs", json={"model": "tiny", "prompt": "hello", "deadline_s": bad}, headers=fleet.auth("acme")
        )
        assert response.status == 400, bad
        assert (await response.json())["error"]["param"] == "deadline_s"
    assert await fleet.redis.xlen(keys.queue("tiny")) == 0


async def test_the_stream_flag_is_queued_only_for_jobs_that_ask_for_token_events(
    client: TestClient, fleet: Fleet
) -> None:
    await submit(client, fleet)
    await submit(client, fleet, stream=True)
    await submit(client, fleet, stream=None)  # null is the default
    assert [message.stream for message in await queued_messages(fleet)] == [False, True, False]
    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "stream": "yes"}, headers=fleet.auth("acme")
    )
    assert response.status == 400 and (await response.json())["error"]["param"] == "stream"


async def test_a_batch_priority_job_is_queued_on_the_models_batch_stream(client: TestClient, fleet: Fleet) -> None:
    body = await submit(client, fleet, priority="batch")

    [message] = await queued_messages(fleet, priority=Priority.BATCH)
    assert (message.job_id, message.priority) == (body["id"], Priority.BATCH)
    assert await queued_messages(fleet) == []
    job = await client.get(f"/v1/jobs/{body['id']}", headers=fleet.auth("acme"))
    assert (await job.json())["priority"] == "batch"


async def test_jobs_are_interactive_unless_asked_otherwise(client: TestClient, fleet: Fleet) -> None:
    body = await submit(client, fleet)

    [message] = await queued_messages(fleet)
    job = await client.get(f"/v1/jobs/{body['id']}", headers=fleet.auth("acme"))
    assert message.priority is Priority.INTERACTIVE and (await job.json())["priority"] == "interactive"


async def test_an_unknown_priority_is_refused_naming_the_field(client: TestClient, fleet: Fleet) -> None:
    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hi", "priority": "urgent"}, headers=fleet.auth("acme")
    )

    assert response.status == 400
    assert (await response.json())["error"]["param"] == "priority"
