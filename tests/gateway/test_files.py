"""The Files API: upload (multipart, purpose=batch, JSONL), list, read, download, delete; limits and
tenant isolation; malformed uploads are 4xx with a code, never a 500."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import FormData
from aiohttp.test_utils import TestClient

from gateway.files import FilePurpose, FileStore
from shared import keys
from shared.config import BatchConfig, GatewayConfig
from tests.gateway.fleet import Fleet

MAX_FILE_BYTES, MAX_LINES, MAX_FILES = 4096, 5, 50


@pytest.fixture
def gateway_config(gateway_config: GatewayConfig) -> GatewayConfig:
    batches = BatchConfig(max_file_bytes=MAX_FILE_BYTES, max_file_lines=MAX_LINES, max_files_per_tenant=MAX_FILES)
    return replace(gateway_config, batches=batches)


def jsonl(*custom_ids: str) -> bytes:
    line = {"method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "hi"}}
    return b"".join(json.dumps({"custom_id": c, **line}).encode() + b"\n" for c in custom_ids)


def form(content: bytes, purpose: str = "batch", filename: str = "in.jsonl") -> FormData:
    data = FormData()
    data.add_field("purpose", purpose)
    data.add_field("file", content, filename=filename, content_type="application/jsonl")
    return data


async def upload(client: TestClient, fleet: Fleet, content: bytes, tenant: str = "acme", **kwargs: Any) -> Any:
    return await client.post("/v1/files", data=form(content, **kwargs), headers=fleet.auth(tenant))


async def uploaded(client: TestClient, fleet: Fleet, content: bytes, tenant: str = "acme") -> dict[str, Any]:
    response = await upload(client, fleet, content, tenant)
    assert response.status == 200, await response.text()
    return await response.json()


async def test_an_uploaded_file_is_listed_read_and_downloaded_as_written(client: TestClient, fleet: Fleet) -> None:
    content = jsonl("a", "b")
    file = await uploaded(client, fleet, content)

    assert file["object"] == "file" and file["purpose"] == "batch" and file["filename"] == "in.jsonl"
    assert file["id"].startswith("file-") and file["bytes"] == len(content)
    listed = await (await client.get("/v1/files", headers=fleet.auth("acme"))).json()
    assert [f["id"] for f in listed["data"]] == [file["id"]]
    got = await client.get(f"/v1/files/{file['id']}", headers=fleet.auth("acme"))
    assert (await got.json()) == file
    downloaded = await client.get(f"/v1/files/{file['id']}/content", headers=fleet.auth("acme"))
    assert await downloaded.read() == content


async def test_a_deleted_file_is_gone(client: TestClient, fleet: Fleet) -> None:
    file = await uploaded(client, fleet, jsonl("a"))

    deleted = await client.delete(f"/v1/files/{file['id']}", headers=fleet.auth("acme"))
    assert (await deleted.json()) == {"id": file["id"], "object": "file", "deleted": True}
    again = await client.get(f"/v1/files/{file['id']}", headers=fleet.auth("acme"))
    assert again.status == 404 and (await again.json())["error"]["code"] == "file_not_found"
    assert not await fleet.redis.exists(keys.file(file["id"]), keys.file_lines(file["id"]))


async def test_another_tenants_file_is_reported_as_missing(client: TestClient, fleet: Fleet) -> None:
    file = await uploaded(client, fleet, jsonl("a"))

    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        response = await client.request(method, f"/v1/files/{file['id']}{path}", headers=fleet.auth("globex"))
        assert response.status == 404 and (await response.json())["error"]["code"] == "file_not_found"
    listed = await (await client.get("/v1/files", headers=fleet.auth("globex"))).json()
    assert listed["data"] == []


async def test_a_tenant_keeps_at_most_its_quota_of_uploads(client: TestClient, fleet: Fleet) -> None:
    store = FileStore(fleet.redis, ttl_s=60)
    kept = [await store.create("acme", "f.jsonl", FilePurpose.BATCH, ['{"custom_id": "a"}']) for _ in range(MAX_FILES)]

    refused = await upload(client, fleet, jsonl("a"))
    assert refused.status == 409 and (await refused.json())["error"]["code"] == "file_quota_exceeded"
    assert (await upload(client, fleet, jsonl("a"), tenant="globex")).status == 200  # another tenant's quota
    await client.delete(f"/v1/files/{kept[0].file_id}", headers=fleet.auth("acme"))
    assert (await upload(client, fleet, jsonl("a"))).status == 200


async def test_expired_files_are_removed_by_the_janitor(client: TestClient, fleet: Fleet) -> None:
    file = await uploaded(client, fleet, jsonl("a"))
    await fleet.redis.zadd(keys.FILE_EXPIRY, {file["id"]: 1})  # as if its time had come

    assert await FileStore(fleet.redis, ttl_s=60).remove_expired() == 1
    assert not await fleet.redis.exists(keys.file(file["id"]), keys.file_lines(file["id"]))
    assert await fleet.redis.zcard(keys.tenant_files("acme")) == 0


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"x" * (MAX_FILE_BYTES + 1), 413, "file_too_large"),
        (jsonl(*"abcdef"), 400, "file_too_many_lines"),
        (b"\xff\xfe" + jsonl("a"), 400, "invalid_file_encoding"),
        (b"\n \n", 400, "empty_file"),
        (b'{"custom_id": "a"}\nnot json\n', 400, "invalid_jsonl"),
        (b"[1, 2]\n", 400, "invalid_jsonl"),
        (b'{"custom_id": "a", "prompt": "\\ud800"}\n', 400, "invalid_jsonl"),  # a lone surrogate, as a body
        (b'{"custom_id": "a", "custom_id": "b"}\n', 400, "invalid_jsonl"),
        (b'{"custom_id": 7}\n', 400, "invalid_jsonl"),
        (jsonl("a", "a"), 400, "invalid_jsonl"),
        (b'{"custom_id": "a", "x": ' + b"[" * 1500 + b"]" * 1500 + b"}\n", 400, "invalid_jsonl"),
    ],
)
async def test_files_past_the_limits_or_not_batch_jsonl_are_refused_with_a_code(
    client: TestClient, fleet: Fleet, content: bytes, status: int, code: str
) -> None:
    response = await upload(client, fleet, content)

    assert response.status == status, await response.text()
    assert (await response.json())["error"]["code"] == code


async def test_a_purpose_other_than_batch_is_refused(client: TestClient, fleet: Fleet) -> None:
    response = await upload(client, fleet, jsonl("a"), purpose="fine-tune")

    assert response.status == 400 and (await response.json())["error"]["code"] == "invalid_purpose"


def malformed_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    """(content type, body) pairs: multipart bodies cut, garbled, mis-declared or mis-encoded."""
    boundary = "b0undary"
    good = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + jsonl("a")
        + f"\r\n--{boundary}--\r\n".encode()
    )
    cases = [
        ("multipart/form-data", good),  # no boundary parameter
        (f"multipart/form-data; boundary={boundary}", b""),
        (f"multipart/form-data; boundary={boundary}", good[: len(good) // 2]),
        ("multipart/form-data; boundary=other", good),
        (f"multipart/form-data; boundary={boundary}", good.replace(b"form-data;", b"\xff\xfe;")),
        (f"multipart/form-data; boundary={boundary}", good.replace(b"batch", "bätch".encode("latin-1"))),
        (f"multipart/form-data; boundary={boundary}", good.replace(b"\r\n\r\n", b"\r\n", 1)),
        (f"multipart/form-data; boundary={boundary}; charset=nonexistent", good),
        (f"multipart/form-data; boundary={boundary}", good.replace(b"Content-Type: application/jsonl",
                                                                  b"Content-Transfer-Encoding: base64")),
        (f"multipart/mixed; boundary={boundary}", good),
        ("application/json", b'{"purpose": "batch"}'),
    ]  # fmt: skip
    for _ in range(40):  # random byte flips and cuts of a good body
        body = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        cases.append((f"multipart/form-data; boundary={boundary}", bytes(body[: rng.randint(1, len(body))])))
    return cases


@pytest.mark.filterwarnings("ignore::aiohttp.BadContentDispositionHeader")
async def test_malformed_uploads_are_refused_with_a_4xx_never_a_500(client: TestClient, fleet: Fleet) -> None:
    for content_type, body in malformed_bodies(random.Random(24)):
        response = await client.post(
            "/v1/files", data=body, headers={**fleet.auth("acme"), "Content-Type": content_type}
        )
        assert 400 <= response.status < 500 or response.status == 200, (content_type, body[:80], response.status)
        if response.status != 200:
            assert (await response.json())["error"]["code"], body[:80]


def odd_jsonl(rng: random.Random) -> bytes:
    """A JSONL upload with odd content: other encodings, control and NUL characters, escapes of lone
    surrogates, huge numbers, random bytes."""
    pieces = [
        '{"custom_id": "\\ud800", "body": {"prompt": "\\udfff"}}',
        '{"custom_id": "a\\u0000b", "x": 1e999999}',
        '{"custom_id": "n", "x": ' + "9" * 5000 + "}",
        '{"custom_id": "d", "custom_id": "d2"}',
        '{"custom_id": "t", "x": NaN}',
        '{"custom_id": ""}',
        '{"custom_id": "' + "c" * 600 + '"}',
    ]
    lines = rng.sample(pieces, rng.randint(1, len(pieces)))
    content = "\n".join(lines).encode(rng.choice(["utf-8", "utf-16", "utf-8-sig", "latin-1"]), errors="replace")
    if rng.random() < 0.3:
        content += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    return content


async def test_odd_jsonl_uploads_are_stored_or_refused_with_a_code_never_a_500(
    client: TestClient, fleet: Fleet
) -> None:
    rng = random.Random(7)
    for _ in range(40):
        content = odd_jsonl(rng)
        response = await upload(client, fleet, content[:MAX_FILE_BYTES])
        assert response.status in (200, 400), (content[:80], response.status)
        if response.status == 200:  # what was stored reads back as it was accepted
            file = await response.json()
            stored = await client.get(f"/v1/files/{file['id']}/content", headers=fleet.auth("acme"))
            assert stored.status == 200 and len(await stored.read()) == file["bytes"]
        else:
            assert (await response.json())["error"]["code"] in {
                "invalid_jsonl", "invalid_file_encoding", "empty_file", "file_too_many_lines"
            }  # fmt: skip
