"""Bad input: each case gets a 4xx with its own code, nothing is queued, and the gateway keeps serving."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.errors import RequestError
from gateway.job_request import parse_job_request
from shared import keys
from shared.config import WebhookConfig
from tests.gateway.fleet import LIMITS, MAX_CONTEXT, WORDS, Fleet, submit


@dataclass(frozen=True)
class Bad:
    body: dict[str, Any] | bytes
    status: int
    code: str
    param: str | None = None


def job(**fields: Any) -> dict[str, Any]:
    """A valid body with `fields` changed."""
    return {"model": "tiny", "prompt": "hello world", **fields}


def raw(text: str) -> bytes:
    return text.encode()


HUGE_INT = "9" * 5000  # over Python's 4300-digit int parsing limit

CASES: dict[str, Bad] = {
    # the body itself
    "malformed-json": Bad(raw('{"model": "tiny",'), 400, "invalid_json"),
    "empty-body": Bad(b"", 400, "invalid_json"),
    "not-utf8": Bad(b'{"model": "\xff\xfe"}', 400, "invalid_json"),
    "nan-literal": Bad(raw('{"model": "tiny", "prompt": "hello", "temperature": NaN}'), 400, "invalid_json"),
    "infinity-literal": Bad(raw('{"model": "tiny", "prompt": "hello", "top_p": -Infinity}'), 400, "invalid_json"),
    "duplicate-keys": Bad(raw('{"model": "tiny", "prompt": "hi", "top_k": 1, "top_k": 9}'), 400, "invalid_json"),
    "deep-nesting": Bad(b"[" * 50_000, 400, "invalid_json"),
    "integer-of-5000-digits": Bad(
        raw('{"model": "tiny", "prompt": "hi", "seed": ' + "9" * 5000 + "}"), 400, "invalid_json"
    ),
    "lone-surrogate-in-prompt": Bad(raw(r'{"model": "tiny", "prompt": "hello \ud800"}'), 400, "invalid_json"),
    "lone-surrogate-in-model": Bad(raw(r'{"model": "tiny\udc00", "prompt": "hello"}'), 400, "invalid_json"),
    "lone-surrogate-in-stop": Bad(raw(r'{"model": "tiny", "prompt": "hi", "stop": ["\ud800"]}'), 400, "invalid_json"),
    "body-is-a-list": Bad(raw('[{"model": "tiny", "prompt": "hello"}]'), 400, "invalid_request"),
    "body-is-a-string": Bad(raw('"hello"'), 400, "invalid_request"),
    "body-over-max-bytes": Bad(job(prompt="hello " * (LIMITS.max_body_bytes // 6 + 1)), 413, "payload_too_large"),
    "unknown-field": Bad(job(temprature=0.5), 400, "invalid_request", "temprature"),
    # model and adapter
    "missing-model": Bad({"prompt": "hello"}, 400, "invalid_request", "model"),
    "model-not-a-string": Bad(job(model=7), 400, "invalid_request", "model"),
    "unknown-model": Bad(job(model="gpt-9"), 404, "model_not_found", "model"),
    "unknown-adapter": Bad(job(adapter="no-such-adapter"), 404, "adapter_not_found", "adapter"),
    "adapter-for-another-model": Bad(job(adapter="acme-other"), 400, "adapter_model_mismatch", "adapter"),
    "adapter-not-a-string": Bad(job(adapter=5), 400, "invalid_request", "adapter"),
    "adapter-empty": Bad(job(adapter=""), 400, "invalid_request", "adapter"),
    # prompt
    "missing-prompt": Bad({"model": "tiny"}, 400, "invalid_request", "prompt"),
    "prompt-an-object": Bad(job(prompt={"text": "hello"}), 400, "invalid_request", "prompt"),
    "empty-prompt": Bad(job(prompt=""), 400, "empty_prompt", "prompt"),
    "empty-token-list": Bad(job(prompt=[]), 400, "empty_prompt", "prompt"),
    "prompt-over-max-chars": Bad(job(prompt="a" * (LIMITS.max_prompt_chars + 1)), 413, "payload_too_large", "prompt"),
    "text-prompt-over-context": Bad(job(prompt="hello " * MAX_CONTEXT), 400, "context_length_exceeded", "prompt"),
    "token-prompt-over-context": Bad(
        job(prompt=[3] * (MAX_CONTEXT - 15)), 400, "context_length_exceeded", "prompt"
    ),  # + 16 default max_tokens
    "max-tokens-over-context": Bad(job(prompt=[3] * 40, max_tokens=25), 400, "context_length_exceeded", "prompt"),
    "token-id-over-vocab": Bad(job(prompt=[3, len(WORDS)]), 400, "invalid_token_id", "prompt"),
    "token-id-negative": Bad(job(prompt=[-1]), 400, "invalid_token_id", "prompt"),
    "token-id-string": Bad(job(prompt=[3, "4"]), 400, "invalid_request", "prompt"),
    "token-id-bool": Bad(job(prompt=[True]), 400, "invalid_request", "prompt"),
    "token-id-float": Bad(job(prompt=[3.0]), 400, "invalid_request", "prompt"),
    # sampling
    "max-tokens-bool": Bad(job(max_tokens=True), 400, "invalid_request", "max_tokens"),
    "max-tokens-string": Bad(job(max_tokens="16"), 400, "invalid_request", "max_tokens"),
    "max-tokens-float": Bad(job(max_tokens=16.0), 400, "invalid_request", "max_tokens"),
    "max-tokens-zero": Bad(job(max_tokens=0), 400, "invalid_request", "max_tokens"),
    "max-tokens-negative": Bad(job(max_tokens=-1), 400, "invalid_request", "max_tokens"),
    "max-tokens-over-limit": Bad(job(max_tokens=LIMITS.max_output_tokens + 1), 400, "invalid_request", "max_tokens"),
    "temperature-negative": Bad(job(temperature=-0.1), 400, "invalid_request", "temperature"),
    "temperature-bool": Bad(job(temperature=True), 400, "invalid_request", "temperature"),
    "temperature-string": Bad(job(temperature="hot"), 400, "invalid_request", "temperature"),
    "temperature-overflows-to-inf": Bad(
        raw('{"model": "tiny", "prompt": "hi", "temperature": 1e999}'), 400, "invalid_request", "temperature"
    ),
    "temperature-int-over-float-range": Bad(job(temperature=10**400), 400, "invalid_request", "temperature"),
    "top-p-zero": Bad(job(top_p=0), 400, "invalid_request", "top_p"),
    "top-p-over-one": Bad(job(top_p=1.5), 400, "invalid_request", "top_p"),
    "top-k-negative": Bad(job(top_k=-1), 400, "invalid_request", "top_k"),
    "top-k-over-int32": Bad(job(top_k=2**31), 400, "invalid_request", "top_k"),
    "top-k-float": Bad(job(top_k=1.5), 400, "invalid_request", "top_k"),
    "seed-negative": Bad(job(seed=-1), 400, "invalid_request", "seed"),
    "seed-over-uint64": Bad(job(seed=2**64), 400, "invalid_request", "seed"),
    "seed-float": Bad(job(seed=1.5), 400, "invalid_request", "seed"),
    "seed-string": Bad(job(seed="42"), 400, "invalid_request", "seed"),
    "seed-bool": Bad(job(seed=True), 400, "invalid_request", "seed"),
    "stop-too-many": Bad(job(stop=["a"] * (LIMITS.max_stop_strings + 1)), 400, "invalid_request", "stop"),
    "stop-too-long": Bad(job(stop=["x" * (LIMITS.max_stop_chars + 1)]), 400, "invalid_request", "stop"),
    "stop-not-strings": Bad(job(stop=[1]), 400, "invalid_request", "stop"),
    "stop-empty-string": Bad(job(stop=[""]), 400, "invalid_request", "stop"),
    "stop-an-object": Bad(job(stop={"a": 1}), 400, "invalid_request", "stop"),
    "ignore-eos-string": Bad(job(ignore_eos="yes"), 400, "invalid_request", "ignore_eos"),
    "ignore-eos-int": Bad(job(ignore_eos=1), 400, "invalid_request", "ignore_eos"),
}


async def queue_lengths(fleet: Fleet) -> list[int]:
    return [await fleet.redis.xlen(keys.queue(model)) for model in fleet.models]


async def post_body(client: TestClient, fleet: Fleet, body: dict[str, Any] | bytes, **headers: str):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.post(
        "/v1/jobs", data=data, headers={**fleet.auth("acme"), "Content-Type": "application/json", **headers}
    )


async def assert_nothing_queued_and_still_serving(client: TestClient, fleet: Fleet) -> None:
    assert await queue_lengths(fleet) == [0, 0]
    assert await fleet.redis.keys(keys.job("*")) == []
    await submit(client, fleet)
    assert await queue_lengths(fleet) == [1, 0]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_bad_job_is_rejected_with_its_code(client: TestClient, fleet: Fleet, case: Bad) -> None:
    response = await post_body(client, fleet, case.body)

    assert response.status == case.status
    error = (await response.json())["error"]
    assert (error["code"], error.get("param")) == (case.code, case.param)
    assert error["message"]
    await assert_nothing_queued_and_still_serving(client, fleet)


def test_unknown_field_message_names_every_unknown_field() -> None:
    with pytest.raises(RequestError) as caught:
        parse_job_request(job(temprature=0.5, top_q=0.9), LIMITS, WebhookConfig())

    assert "temprature" in caught.value.message
    assert "top_q" in caught.value.message


@pytest.mark.parametrize("key", ["has space", "x" * 256, "naïve"], ids=["space", "too-long", "non-ascii"])
async def test_bad_idempotency_key_is_rejected(client: TestClient, fleet: Fleet, key: str) -> None:
    response = await post_body(client, fleet, job(), **{"Idempotency-Key": key})

    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "Idempotency-Key")
    await assert_nothing_queued_and_still_serving(client, fleet)


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_api_key"),
        ("Bearer ", "missing_api_key"),
        ("Basic YWNtZTpzZWNyZXQ=", "invalid_api_key"),
        ("Bearer not-a-key", "invalid_api_key"),
        ("Bearer lf_0123456789abcdef_" + "s" * 43, "invalid_api_key"),
    ],
    ids=["absent", "blank", "basic-scheme", "malformed-key", "unknown-key"],
)
async def test_missing_or_bad_api_key_is_401(
    client: TestClient, fleet: Fleet, authorization: str | None, code: str
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}

    response = await client.post("/v1/jobs", json=job(), headers=headers)

    assert response.status == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await response.json())["error"]["code"] == code
    await assert_nothing_queued_and_still_serving(client, fleet)


async def test_another_tenants_key_with_a_wrong_secret_is_401(client: TestClient, fleet: Fleet) -> None:
    lookup = fleet.api_keys["acme"].split("_")[1]

    response = await client.post("/v1/jobs", json=job(), headers={"Authorization": f"Bearer lf_{lookup}_{'x' * 43}"})

    assert response.status == 401
    assert (await response.json())["error"]["code"] == "invalid_api_key"


async def test_disabled_tenant_is_403(client: TestClient, fleet: Fleet) -> None:
    await fleet.redis.hset(keys.tenant("acme"), "disabled", 1)

    response = await client.post("/v1/jobs", json=job(), headers=fleet.auth("acme"))

    assert response.status == 403
    assert (await response.json())["error"]["code"] == "tenant_disabled"
