"""`GET /v1/jobs/{id}/events`: token events then the end, as server-sent events, for the owner only."""

from __future__ import annotations

import json

from tests.gateway.fleet import next_queued_job, play_worker, submit


def _events(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        events.append({"id": fields["id"], "event": fields["event"], "data": json.loads(fields["data"])})
    return events


async def test_events_stream_tokens_then_the_final_job(client, fleet):
    job = await submit(client, fleet)
    message = await next_queued_job(fleet.redis)
    await play_worker(fleet.redis, message, ["the", " fox"], "the fox")
    response = await client.get(f"/v1/jobs/{job['id']}/events", headers=fleet.auth("acme"))
    assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
    events = _events(await response.text())
    assert [e["event"] for e in events] == ["token", "token", "end"]
    assert events[0]["data"] == {"text": "the", "token_ids": [3], "offset": 0}
    assert events[1]["data"]["offset"] == 3
    assert events[2]["data"]["status"] == "succeeded" and events[2]["data"]["output"]["text"] == "the fox"


async def test_last_event_id_resumes_after_that_event(client, fleet):
    job = await submit(client, fleet)
    await play_worker(fleet.redis, await next_queued_job(fleet.redis), ["the", " fox"], "the fox")
    first = _events(await (await client.get(f"/v1/jobs/{job['id']}/events", headers=fleet.auth("acme"))).text())
    headers = {**fleet.auth("acme"), "Last-Event-ID": first[0]["id"]}
    resumed = _events(await (await client.get(f"/v1/jobs/{job['id']}/events", headers=headers)).text())
    assert resumed == first[1:]


async def test_another_tenants_job_events_are_not_found(client, fleet):
    job = await submit(client, fleet)
    response = await client.get(f"/v1/jobs/{job['id']}/events", headers=fleet.auth("globex"))
    assert response.status == 404 and (await response.json())["error"]["code"] == "job_not_found"


async def test_bad_last_event_id_is_a_400(client, fleet):
    job = await submit(client, fleet)
    headers = {**fleet.auth("acme"), "Last-Event-ID": "zzz"}
    response = await client.get(f"/v1/jobs/{job['id']}/events", headers=headers)
    assert response.status == 400 and (await response.json())["error"]["param"] == "Last-Event-ID"


async def test_a_canceled_job_ends_its_stream(client, fleet):
    job = await submit(client, fleet)
    await client.post(f"/v1/jobs/{job['id']}/cancel", headers=fleet.auth("acme"))
    events = _events(await (await client.get(f"/v1/jobs/{job['id']}/events", headers=fleet.auth("acme"))).text())
    assert [e["event"] for e in events] == ["end"] and events[0]["data"]["status"] == "canceled"
