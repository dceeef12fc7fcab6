"""Job webhooks against a real aiohttp receiver and the real Redis: refused at submit off the
allow-list, called once with the finished job and a verifiable signature, retried with backoff,
delivered once by several gateways, and not lost when the gateway that took a delivery dies."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.webhook_signature import DELIVERY_HEADER, SIGNATURE_HEADER, verify_signature
from gateway.webhooks import ATTEMPT_HEADER
from shared import keys
from shared.config import GatewayConfig, WebhookConfig
from shared.jobstore import JobStore, now_ms
from shared.schema import JobMessage, JobRecord, JobStatus, SamplingParams
from tests.gateway.fleet import LIMITS, Fleet, next_queued_job, play_worker, submit

WEBHOOKS = WebhookConfig(
    allow_hosts=("127.0.0.1", "*.hooks.example"),
    secret="test-secret",
    allow_http=True,
    timeout_s=0.5,
    retry_base_s=0.6,
    max_attempts=3,
)


@dataclass
class Call:
    at: float
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A webhook endpoint that answers each call with the next of `statuses` (then 200)."""

    statuses: list[int] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(Call(time.monotonic(), dict(request.headers), await request.read()))
        return web.Response(status=self.statuses.pop(0) if self.statuses else 200)

    async def wait_for(self, count: int, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.calls) < count:
            assert time.monotonic() < deadline, f"{len(self.calls)} webhook calls, expected {count}"
            await asyncio.sleep(0.05)


@pytest.fixture
async def receiver(aiohttp_server: Any) -> Receiver:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    server: TestServer = await aiohttp_server(app)
    receiver.url = str(server.make_url("/hook"))
    return receiver


@pytest.fixture
def gateway_config(redis_url: str) -> GatewayConfig:
    return GatewayConfig(redis_url=redis_url, limits=LIMITS, webhooks=WEBHOOKS)


async def finish_next_job(fleet: Fleet) -> str:
    message = await next_queued_job(fleet.redis)
    await play_worker(fleet.redis, message, ["the"], "the fox")
    return message.job_id


async def assert_nothing_left(fleet: Fleet, timeout_s: float = 5.0) -> None:
    """Every delivery acknowledged and deleted: a gateway does both once the receiver's answer has
    reached it, after the receiver recorded the call, so this waits for them (at most timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = await fleet.redis.xlen(keys.WEBHOOKS)
        pending = (await fleet.redis.xpending(keys.WEBHOOKS, keys.WEBHOOK_GROUP))["pending"]
        if left == pending == 0:
            return
        assert time.monotonic() < deadline, f"{left} deliveries left in the stream, {pending} pending"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("webhook", "code"),
    [
        ("http://evil.example/hook", "webhook_not_allowed"),
        ("http://hooks.example/hook", "webhook_not_allowed"),  # *.hooks.example is its subdomains only
        ("http://user:pw@127.0.0.1/hook", "invalid_request"),
        ("ftp://127.0.0.1/hook", "invalid_request"),
        ("/hook", "invalid_request"),
        (42, "invalid_request"),
    ],
)
async def test_a_webhook_off_the_allow_list_is_refused_at_submit(client: TestClient, fleet: Fleet, webhook, code):
    response = await client.post(
        "/v1/jobs", json={"model": "tiny", "prompt": "hello", "webhook": webhook}, headers=fleet.auth("acme")
    )
    assert response.status == 400
    assert (await response.json())["error"] | {"message": ""} == {"code": code, "message": "", "param": "webhook"}
    assert await fleet.redis.xlen(keys.queue("tiny")) == 0


async def test_subdomains_of_a_wildcard_entry_are_allowed(client: TestClient, fleet: Fleet):
    await submit(client, fleet, webhook="http://a.b.hooks.example/x")
    assert (await next_queued_job(fleet.redis)).job_id


async def test_https_is_required_unless_http_is_allowed(aiohttp_client: Any, redis_url: str, fleet: Fleet):
    https_only = WebhookConfig(allow_hosts=("127.0.0.1",), secret="s")
    client = await aiohttp_client(create_app(GatewayConfig(redis_url=redis_url, limits=LIMITS, webhooks=https_only)))
    body = {"model": "tiny", "prompt": "hello", "webhook": "http://127.0.0.1/hook"}
    response = await client.post("/v1/jobs", json=body, headers=fleet.auth("acme"))
    assert response.status == 400 and (await response.json())["error"]["code"] == "webhook_not_allowed"
    await submit(client, fleet, webhook="https://127.0.0.1/hook")


async def test_a_gateway_without_webhooks_refuses_them(aiohttp_client: Any, redis_url: str, fleet: Fleet):
    client = await aiohttp_client(create_app(GatewayConfig(redis_url=redis_url, limits=LIMITS)))
    body = {"model": "tiny", "prompt": "hello", "webhook": "https://127.0.0.1/hook"}
    response = await client.post("/v1/jobs", json=body, headers=fleet.auth("acme"))
    assert response.status == 400 and (await response.json())["error"]["code"] == "webhook_not_allowed"
    response = await client.get("/v1/webhooks/key", headers=fleet.auth("acme"))
    assert response.status == 400 and (await response.json())["error"]["code"] == "webhook_not_allowed"


async def test_a_finished_job_is_posted_once_with_a_signature_its_tenant_can_verify(
    client: TestClient, fleet: Fleet, receiver: Receiver
):
    job = await submit(client, fleet, webhook=receiver.url)
    await finish_next_job(fleet)
    await receiver.wait_for(1)
    await asyncio.sleep(2 * WEBHOOKS.retry_base_s)  # time enough for a second call, if there were one
    (call,) = receiver.calls

    key = (await (await client.get("/v1/webhooks/key", headers=fleet.auth("acme"))).json())["key"]
    assert verify_signature(key, call.headers[SIGNATURE_HEADER], call.body, now=time.time())
    other_key = (await (await client.get("/v1/webhooks/key", headers=fleet.auth("globex"))).json())["key"]
    assert not verify_signature(other_key, call.headers[SIGNATURE_HEADER], call.body, now=time.time())
    assert not verify_signature(key, call.headers[SIGNATURE_HEADER], call.body + b" ", now=time.time())
    assert not verify_signature(key, call.headers[SIGNATURE_HEADER], call.body, now=time.time() + 3600)

    posted = json.loads(call.body)
    assert posted == await (await client.get(f"/v1/jobs/{job['id']}", headers=fleet.auth("acme"))).json()
    assert posted["status"] == "succeeded" and posted["output"]["text"] == "the fox"
    assert call.headers["Content-Type"] == "application/json" and call.headers[ATTEMPT_HEADER] == "1"
    await assert_nothing_left(fleet)


async def test_a_canceled_job_calls_its_webhook_too(client: TestClient, fleet: Fleet, receiver: Receiver):
    job = await submit(client, fleet, webhook=receiver.url)
    await client.post(f"/v1/jobs/{job['id']}/cancel", headers=fleet.auth("acme"))
    await receiver.wait_for(1)
    assert json.loads(receiver.calls[0].body)["status"] == "canceled"


async def test_a_job_without_a_webhook_queues_no_delivery(client: TestClient, fleet: Fleet):
    await submit(client, fleet)
    await finish_next_job(fleet)
    assert await fleet.redis.xlen(keys.WEBHOOKS) == 0


async def test_a_failing_receiver_is_retried_with_exponential_backoff(
    client: TestClient, fleet: Fleet, receiver: Receiver
):
    receiver.statuses = [500, 503]
    await submit(client, fleet, webhook=receiver.url)
    await finish_next_job(fleet)
    await receiver.wait_for(3)

    assert [call.headers[ATTEMPT_HEADER] for call in receiver.calls] == ["1", "2", "3"]
    assert len({call.headers[DELIVERY_HEADER] for call in receiver.calls}) == 1, "one delivery, one id"
    gaps = [later.at - earlier.at for earlier, later in zip(receiver.calls, receiver.calls[1:], strict=False)]
    assert gaps[0] >= WEBHOOKS.retry_base_s and gaps[1] >= 2 * WEBHOOKS.retry_base_s
    await assert_nothing_left(fleet)


async def test_a_receiver_that_keeps_failing_is_abandoned_after_max_attempts(
    client: TestClient, fleet: Fleet, receiver: Receiver
):
    receiver.statuses = [500] * 10
    await submit(client, fleet, webhook=receiver.url)
    await finish_next_job(fleet)
    await receiver.wait_for(WEBHOOKS.max_attempts)
    await asyncio.sleep(4 * WEBHOOKS.retry_base_s + 1.0)
    assert len(receiver.calls) == WEBHOOKS.max_attempts
    await assert_nothing_left(fleet)
    metrics = await (await client.get("/metrics")).text()
    assert 'lorafleet_gateway_webhooks_total{outcome="abandoned"} 1.0' in metrics


async def test_several_gateways_call_each_webhook_once(
    aiohttp_client: Any, gateway_config: GatewayConfig, fleet: Fleet, receiver: Receiver
):
    gateways = [await aiohttp_client(create_app(gateway_config)) for _ in range(3)]
    for index in range(12):
        await submit(gateways[index % 3], fleet, webhook=receiver.url)
        await finish_next_job(fleet)
    await receiver.wait_for(12)
    await asyncio.sleep(2 * WEBHOOKS.retry_base_s)
    bodies = [json.loads(call.body)["id"] for call in receiver.calls]
    assert len(bodies) == len(set(bodies)) == 12
    await assert_nothing_left(fleet)


async def queue_finished_job_with_webhook(fleet: Fleet, url: str) -> str:
    """A job of acme's with a webhook, finished while no gateway runs: its delivery waits in lf:webhooks."""
    store = JobStore(fleet.redis, 3600)
    record = JobRecord("job_" + "ab" * 16, JobStatus.QUEUED, "acme", "tiny", None, now_ms(), webhook=url)
    message = JobMessage(record.job_id, "acme", "tiny", (1, 3), SamplingParams())
    await store.create(record, message)
    await finish_next_job(fleet)
    return record.job_id


async def test_a_delivery_queued_while_no_gateway_ran_is_made_when_one_starts(
    aiohttp_client: Any, gateway_config: GatewayConfig, fleet: Fleet, receiver: Receiver
):
    job_id = await queue_finished_job_with_webhook(fleet, receiver.url)
    assert await fleet.redis.xlen(keys.WEBHOOKS) == 1
    await aiohttp_client(create_app(gateway_config))
    await receiver.wait_for(1)
    assert json.loads(receiver.calls[0].body)["id"] == job_id
    await assert_nothing_left(fleet)


async def test_a_delivery_taken_by_a_gateway_that_died_is_made_by_another_after_the_backoff(
    aiohttp_client: Any, gateway_config: GatewayConfig, fleet: Fleet, receiver: Receiver
):
    await queue_finished_job_with_webhook(fleet, receiver.url)
    # a gateway read the entry (it is pending on that consumer) and died before calling
    await fleet.redis.xgroup_create(keys.WEBHOOKS, keys.WEBHOOK_GROUP, id="0")
    taken = time.monotonic()  # at or before the delivery, whose time Redis keeps to the millisecond
    await fleet.redis.xreadgroup(keys.WEBHOOK_GROUP, "dead-gateway", {keys.WEBHOOKS: ">"}, count=1)
    await aiohttp_client(create_app(gateway_config))
    await receiver.wait_for(1)
    assert receiver.calls[0].at - taken >= WEBHOOKS.retry_base_s - 0.001
    assert receiver.calls[0].headers[ATTEMPT_HEADER] == "2"
    await assert_nothing_left(fleet)
