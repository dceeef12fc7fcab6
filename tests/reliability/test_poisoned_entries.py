"""Poisoned queue entries and job records, written straight into Redis as a buggy or older producer or
a bad restore could: a real worker dead-letters each with a reason naming what is wrong, at its first
delivery (fresh, or claimed from a worker that died holding it), stays up, and serves the next job."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from shared import keys
from shared.jobstore import JobStore, now_ms
from shared.schema import SCHEMA_VERSION, JobMessage, JobRecord, JobStatus, SamplingParams, encode_job
from tests.e2e.processes import wait_until
from tests.fleet import MODEL, TENANT, Fleet

pytestmark = pytest.mark.slow

_MISSING = object()
LONG_JOB_TOKENS = 300  # seconds on a CPU: the record is replaced long before it ends


def message(job_id: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A valid message's map for `job_id` with `changes` ("sampling.top_p": value; _MISSING deletes)."""
    valid = JobMessage(job_id, TENANT, MODEL, (1, 2, 3), SamplingParams(max_tokens=2, temperature=0.0))
    fields = msgpack.unpackb(encode_job(valid))
    for path, value in (changes or {}).items():
        target = fields
        *parents, name = path.split(".")
        for parent in parents:
            target = target[parent]
        if value is _MISSING:
            del target[name]
        else:
            target[name] = value
    return fields


# (field path, value): each a message whose envelope (`v`) is right and one field is not
BAD_FIELDS: list[tuple[str, Any]] = [
    ("prompt_token_ids", "abc"), ("prompt_token_ids", []), ("prompt_token_ids", [1, "2"]),
    ("prompt_token_ids", [1, True]), ("prompt_token_ids", [1.5]), ("prompt_token_ids", [-1]),
    ("prompt_token_ids", [2**40]), ("prompt_token_ids", None), ("prompt_token_ids", {"0": 1}),
    ("prompt_token_ids", _MISSING),
    ("deadline", "soon"), ("deadline", math.nan), ("deadline", math.inf), ("deadline", -1.0), ("deadline", [1.0]),
    ("created_at", "now"), ("created_at", None), ("created_at", _MISSING),
    ("job_id", 7), ("job_id", ""), ("job_id", None), ("job_id", b"raw"), ("job_id", "j" * 5000),
    ("tenant", None), ("tenant", ["t"]), ("model", 1), ("request_id", 5), ("stream", "yes"), ("stream", 0),
    ("sampling", None), ("sampling", "greedy"), ("sampling", [2, 0.0]), ("sampling", _MISSING),
    ("sampling.max_tokens", "2"), ("sampling.max_tokens", 0), ("sampling.max_tokens", 2**40),
    ("sampling.max_tokens", 2.0), ("sampling.max_tokens", _MISSING),
    ("sampling.temperature", "hot"), ("sampling.temperature", -1.0), ("sampling.temperature", math.nan),
    ("sampling.temperature", True), ("sampling.top_p", 0.0), ("sampling.top_p", 2.0), ("sampling.top_p", None),
    ("sampling.top_k", -1), ("sampling.top_k", "5"), ("sampling.seed", -1), ("sampling.seed", "7"),
    ("sampling.stop", "\n"), ("sampling.stop", [1]), ("sampling.stop", ["s"] * 65),
    ("sampling.ignore_eos", "no"), ("sampling.ignore_eos", None),
    ("adapter", "acme-style"), ("adapter", [1]), ("adapter", {}),
    ("adapter", {"name": "a", "version": "1", "path": "p", "digest": "sha256-pieces-8MiB:" + "0" * 64}),
    ("adapter", {"name": "a", "version": 1, "path": "p", "digest": ""}),
]  # fmt: skip
# whole entries that are no job message of this release, and what their reason names
BAD_ENTRIES: list[tuple[dict[bytes, bytes], str]] = [
    ({b"job": b"\xc1 not msgpack"}, "msgpack"),
    ({b"job": b""}, "msgpack"),
    ({b"job": msgpack.packb([1, 2, 3])}, "version"),
    ({b"job": msgpack.packb("a string")}, "version"),
    ({b"job": msgpack.packb(None)}, "version"),
    ({b"job": msgpack.packb({**message("v-next"), "v": SCHEMA_VERSION + 1})}, "version"),
    ({b"job": msgpack.packb({**message("v-sha256"), "v": 1})}, "version"),  # named its adapter by plain sha256
    ({b"job": msgpack.packb({**message("v-text"), "v": "1"})}, "version"),
    ({b"job": msgpack.packb({k: v for k, v in message("no-v").items() if k != "v"})}, "version"),
    ({b"payload": encode_job(JobMessage("no-job-field", TENANT, MODEL, (1,), SamplingParams()))}, "no job field"),
]


def record(**changes: str | bytes) -> dict[str | int | bytes, str | int | bytes]:
    """A queued job's hash as the gateway writes it, with `changes`."""
    fields = JobRecord("poisoned", JobStatus.QUEUED, TENANT, MODEL, None, now_ms()).hset_fields()
    return {**dict(zip(fields[::2], fields[1::2], strict=True)), **changes}


# (name, how the job's key is poisoned, what the reason names): each job's message is valid
BAD_RECORDS: list[tuple[str, Callable[[redis.Redis, str], Any], str]] = [
    ("status-bogus", lambda c, k: c.hset(k, mapping=record(status="bogus")), "status"),
    ("status-empty", lambda c, k: c.hset(k, mapping=record(status="")), "status"),
    ("status-upper", lambda c, k: c.hset(k, mapping=record(status="QUEUED")), "status"),
    ("status-binary", lambda c, k: c.hset(k, mapping=record(status=b"\xff\xfe")), "status"),
    ("attempts-text", lambda c, k: c.hset(k, mapping=record(attempts="many")), "not an integer"),
    ("attempts-float", lambda c, k: c.hset(k, mapping=record(attempts="1.5")), "not an integer"),
    ("attempts-empty", lambda c, k: c.hset(k, mapping=record(attempts="")), "not an integer"),
    ("attempts-overflow", lambda c, k: c.hset(k, mapping=record(attempts=str(2**63 - 1))), "overflow"),
    ("attempts-running", lambda c, k: c.hset(k, mapping=record(status="running", attempts="x")), "integer"),
    ("attempts-done", lambda c, k: c.hset(k, mapping=record(status="succeeded", attempts="x")), "attempts"),
    ("type-string", lambda c, k: c.set(k, "queued"), "WRONGTYPE"),
    ("type-list", lambda c, k: c.rpush(k, "status", "queued"), "WRONGTYPE"),
    ("type-set", lambda c, k: c.sadd(k, "queued"), "WRONGTYPE"),
    ("type-zset", lambda c, k: c.zadd(k, {"queued": 1}), "WRONGTYPE"),
    ("type-stream", lambda c, k: c.xadd(k, {"status": "queued"}), "WRONGTYPE"),
]


def create_jobs(fleet: Fleet, job_ids: list[str], *, stream: bool = False, max_tokens: int = 2) -> None:
    """Queue valid jobs as the gateway does (record and entry in one script)."""

    async def create() -> None:
        async with aioredis.Redis.from_url(fleet.redis_url) as client:
            store = JobStore(client, job_ttl_s=600)
            for job_id in job_ids:
                sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                job = JobMessage(job_id, TENANT, MODEL, (1, 2, 3), sampling, created_at=time.time(), stream=stream)
                await store.create(JobRecord(job_id, JobStatus.QUEUED, TENANT, MODEL, None, now_ms()), job)

    asyncio.run(create())


def abandon_everything_queued(client: redis.Redis) -> None:
    """Read every queued entry as a worker that then died: each is pending, for another worker to claim."""
    client.xgroup_create(keys.queue(MODEL), keys.WORKER_GROUP, id="0", mkstream=True)
    client.xreadgroup(keys.WORKER_GROUP, "dead-worker", {keys.queue(MODEL): ">"})


def dead_letters(client: redis.Redis) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in client.xrange(keys.DEAD_LETTER)]


def assert_served_after(fleet: Fleet, worker_name: str, control: str, dead: int) -> None:
    """`dead` entries were dead-lettered, then `control` was served by the worker, and nothing is left queued."""
    with fleet.redis() as client:
        wait_until(lambda: client.xlen(keys.DEAD_LETTER) >= dead, timeout_s=30, what="dead letters", logs=fleet.logs)
    [done] = fleet.wait_finished([control], timeout_s=30)
    assert done.status is JobStatus.SUCCEEDED and done.worker == worker_name, done
    with fleet.redis() as client:
        assert client.xlen(keys.queue(MODEL)) == 0
        assert client.xpending(keys.queue(MODEL), keys.WORKER_GROUP)["pending"] == 0


def test_messages_with_wrongly_typed_fields_are_dead_lettered_naming_the_field(fleet: Fleet):
    worker = fleet.start_worker("w1")
    with fleet.redis() as client:
        for index, (path, value) in enumerate(BAD_FIELDS):
            client.xadd(keys.queue(MODEL), {b"job": msgpack.packb(message(f"bad-{index}", {path: value}))})
        for fields, _ in BAD_ENTRIES:
            client.xadd(keys.queue(MODEL), fields)
    create_jobs(fleet, ["control"])

    assert_served_after(fleet, "w1", "control", dead=len(BAD_FIELDS) + len(BAD_ENTRIES))
    with fleet.redis() as client:
        letters = dead_letters(client)
    assert len(letters) == len(BAD_FIELDS) + len(BAD_ENTRIES)
    expected = [path for path, _ in BAD_FIELDS] + [reason for _, reason in BAD_ENTRIES]
    for letter, names in zip(letters, expected, strict=True):
        assert names in letter[b"reason"].decode(), (names, letter)
        assert letter[b"model"] == MODEL.encode()
    assert worker.poll() is None


def test_unreadable_job_records_are_dead_lettered_at_once_by_whichever_worker_claims_them(fleet: Fleet):
    job_ids = [f"poisoned-{name}" for name, _, _ in BAD_RECORDS]
    create_jobs(fleet, job_ids)
    with fleet.redis() as client:
        for job_id, (_, poison, _) in zip(job_ids, BAD_RECORDS, strict=True):
            client.delete(keys.job(job_id))
            poison(client, keys.job(job_id))
        abandon_everything_queued(client)  # the next worker finds them pending, as after a crash
    worker = fleet.start_worker("heir")
    create_jobs(fleet, ["control"])

    assert_served_after(fleet, "heir", "control", dead=len(BAD_RECORDS))
    with fleet.redis() as client:
        letters = dead_letters(client)
    assert len(letters) == len(BAD_RECORDS)
    for letter, (name, _, names) in zip(letters, BAD_RECORDS, strict=True):
        assert names in letter[b"reason"].decode(), (name, letter)
    assert worker.poll() is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_job_whose_events_key_is_of_another_type_is_dead_lettered_when_it_ends(fleet: Fleet, stream: bool):
    poisons = [
        lambda c, k: c.set(k, "x"), lambda c, k: c.rpush(k, "x"), lambda c, k: c.sadd(k, "x"),
        lambda c, k: c.hset(k, "x", "y"), lambda c, k: c.zadd(k, {"x": 1}),
    ]  # fmt: skip
    job_ids = [f"events-{index}" for index in range(len(poisons))]
    with fleet.redis() as client:
        for job_id, poison in zip(job_ids, poisons, strict=True):
            poison(client, keys.job_events(job_id))
    create_jobs(fleet, job_ids, stream=stream)
    worker = fleet.start_worker("w1")
    create_jobs(fleet, ["control"], stream=stream)

    assert_served_after(fleet, "w1", "control", dead=len(job_ids))
    with fleet.redis() as client:
        letters = dead_letters(client)
        assert sorted(msgpack.unpackb(letter[b"job"])["job_id"] for letter in letters) == sorted(job_ids)
        assert all(b"WRONGTYPE" in letter[b"reason"] for letter in letters)
    assert worker.poll() is None


def test_a_record_replaced_by_another_type_while_its_job_runs_is_dead_lettered(fleet: Fleet):
    worker = fleet.start_worker("w1")
    create_jobs(fleet, ["long"], max_tokens=LONG_JOB_TOKENS)
    with fleet.redis() as client:
        while client.hget(keys.job("long"), "status") != b"running":  # polled tightly: the job must not end first
            assert worker.poll() is None
        worker.send_signal(signal.SIGSTOP)  # the job cannot end while its record is replaced
        try:
            client.delete(keys.job("long"))
            client.rpush(keys.job("long"), "running")
        finally:
            worker.send_signal(signal.SIGCONT)
    create_jobs(fleet, ["control"])

    assert_served_after(fleet, "w1", "control", dead=1)
    with fleet.redis() as client:
        [letter] = dead_letters(client)
    assert msgpack.unpackb(letter[b"job"])["job_id"] == "long" and b"WRONGTYPE" in letter[b"reason"]
    assert worker.poll() is None
