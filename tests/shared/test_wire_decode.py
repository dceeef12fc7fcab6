"""The wire schema's typed decode: a queue message or job hash with a field of the wrong type or range
is refused with SchemaError naming the field, never another exception; a seeded fuzzer substitutes
odd values field by field and checks that whatever decodes is exactly what was written."""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import msgpack
import pytest

from shared import keys
from shared.jobstore import JobStore, now_ms
from shared.schema import (
    AdapterRef,
    FinishReason,
    JobMessage,
    JobOutput,
    JobRecord,
    JobStatus,
    SamplingParams,
    SchemaError,
    decode_job,
    encode_job,
    encode_output,
)

MESSAGE = JobMessage(
    job_id="job_1",
    tenant="acme",
    model="m",
    prompt_token_ids=(1, 2, 3),
    sampling=SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9, top_k=5, seed=7, stop=("\n",)),
    adapter=AdapterRef("a", 2, "acme/a", "0" * 64),
    created_at=1.5,
    deadline=9.0,
    request_id="req-1",
    stream=True,
)
FIELDS: dict[str, Any] = msgpack.unpackb(encode_job(MESSAGE))
# every field path of a message (nested maps' fields as "map.field")
PATHS = [
    *(name for name in FIELDS if name not in ("v", "sampling", "adapter")),
    "sampling",
    "adapter",
    *(f"sampling.{name}" for name in FIELDS["sampling"]),
    *(f"adapter.{name}" for name in FIELDS["adapter"]),
]
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 2**64 - 1, 1.5, -0.0, math.nan, math.inf, -math.inf,
    1e308, "", "abc", "soon", "1", "x" * 5000, b"bytes", b"\xff\xfe", [], [1, 2], [1, "a"], [-1], [2**40], ["a"],
    [None], [True], {}, {"a": 1}, [[1]], "\x00",
]  # fmt: skip


def encoded(fields: dict[str, Any]) -> bytes:
    return msgpack.packb(fields)


def with_value(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    fields = copy.deepcopy(FIELDS if base is None else base)
    target = fields
    *parents, name = path.split(".")
    for parent in parents:
        if not isinstance(target.get(parent), dict):
            return fields  # an earlier substitution replaced the map itself
        target = target[parent]
    target[name] = value
    return fields


def without(path: str) -> dict[str, Any]:
    fields = copy.deepcopy(FIELDS)
    target = fields
    *parents, name = path.split(".")
    for parent in parents:
        target = target[parent]
    del target[name]
    return fields


def refused(fields: dict[str, Any]) -> str:
    with pytest.raises(SchemaError) as caught:
        decode_job(encoded(fields))
    return str(caught.value)


def test_the_message_round_trips():
    assert decode_job(encode_job(MESSAGE)) == MESSAGE


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("prompt_token_ids", "abc"),
        ("prompt_token_ids", [1, "2"]),
        ("prompt_token_ids", [1, True]),
        ("prompt_token_ids", [1, 2.0]),
        ("prompt_token_ids", [-1]),
        ("prompt_token_ids", [2**40]),
        ("prompt_token_ids", []),
        ("prompt_token_ids", {"0": 1}),
        ("deadline", "soon"),
        ("deadline", math.nan),
        ("deadline", math.inf),
        ("deadline", -5.0),
        ("deadline", [9.0]),
        ("created_at", "now"),
        ("created_at", None),
        ("job_id", 7),
        ("job_id", ""),
        ("job_id", "j" * 5000),
        ("job_id", b"job_1"),
        ("tenant", None),
        ("model", ["m"]),
        ("request_id", 5),
        ("stream", "no"),
        ("stream", 1),
        ("sampling", [4, 0.5]),
        ("sampling", "greedy"),
        ("sampling", None),
        ("sampling.max_tokens", 0),
        ("sampling.max_tokens", -1),
        ("sampling.max_tokens", 2**40),
        ("sampling.max_tokens", "4"),
        ("sampling.max_tokens", 4.0),
        ("sampling.temperature", -1.0),
        ("sampling.temperature", math.nan),
        ("sampling.temperature", math.inf),
        ("sampling.temperature", "hot"),
        ("sampling.temperature", True),
        ("sampling.top_p", 0.0),
        ("sampling.top_p", 1.5),
        ("sampling.top_p", None),
        ("sampling.top_k", -1),
        ("sampling.top_k", 2**63),
        ("sampling.seed", -1),
        ("sampling.seed", -(2**63)),
        ("sampling.seed", "7"),
        ("sampling.seed", 7.5),
        ("sampling.stop", "\n"),
        ("sampling.stop", [1]),
        ("sampling.stop", ["s"] * 65),
        ("sampling.stop", ["s" * 5000]),
        ("sampling.ignore_eos", "yes"),
        ("sampling.ignore_eos", None),
        ("adapter", "a"),
        ("adapter", [1]),
        ("adapter.name", None),
        ("adapter.version", "2"),
        ("adapter.version", 0),
        ("adapter.version", True),
        ("adapter.path", 5),
        ("adapter.digest", ""),
        ("adapter.digest", None),
        ("priority", "high"),
        ("priority", 1),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_refused_naming_it(path: str, value: Any):
    message = refused(with_value(path, value))
    assert path in message, message


@pytest.mark.parametrize("path", [p for p in PATHS if p not in ("stream", "priority", "deadline", "sampling.seed")])
def test_a_missing_field_is_refused_naming_it(path: str):
    assert path in refused(without(path))


@pytest.mark.parametrize("path", ["deadline", "sampling.seed"])
def test_an_optional_field_may_be_null_or_absent(path: str):
    assert decode_job(encoded(with_value(path, None))) == decode_job(encoded(without(path)))


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"not msgpack at all", msgpack.packb([1, 2]), msgpack.packb("job"), msgpack.packb({"v": "1"})],
)
def test_bytes_that_are_no_message_of_this_version_are_refused(payload: bytes):
    with pytest.raises(SchemaError):
        decode_job(payload)


def test_fields_unknown_to_this_release_are_ignored():
    assert decode_job(encoded({**FIELDS, "urgency": "high", "extra": [1, {"x": None}]})) == MESSAGE


def test_fuzzed_messages_decode_to_what_was_written_or_raise_schema_error_naming_the_field():
    """Seeded: 4,000 messages with one to three fields (nested ones too) replaced by odd values."""
    rng = random.Random(18)
    accepted = 0
    for _ in range(4000):
        fields = copy.deepcopy(FIELDS)
        paths = rng.sample(PATHS, rng.randint(1, 3))
        for path in paths:
            fields = with_value(path, rng.choice(ODD_VALUES), fields)
        try:
            message = decode_job(encoded(fields))
        except SchemaError as exc:
            assert any(path in str(exc) for path in paths), (paths, str(exc))
            continue
        accepted += 1
        assert encoded_fields(message) == normalised(fields), paths  # nothing decoded but what was written


def encoded_fields(message: JobMessage) -> dict[str, Any]:
    return msgpack.unpackb(encode_job(message))


def normalised(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` as a decoded message encodes them again: numbers as floats where the schema has floats."""
    fields = copy.deepcopy(fields)
    for name in ("created_at", "deadline"):
        if isinstance(fields.get(name), int):
            fields[name] = float(fields[name])
    for name in ("temperature", "top_p"):
        if isinstance(fields["sampling"].get(name), int):
            fields["sampling"][name] = float(fields["sampling"][name])
    return fields


RECORD = JobRecord(
    job_id="job_1",
    status=JobStatus.SUCCEEDED,
    tenant="acme",
    model="m",
    adapter="a",
    created_ms=10,
    started_ms=11,
    first_token_ms=12,
    finished_ms=13,
    prompt_tokens=3,
    completion_tokens=2,
    attempts=1,
    worker="w1",
    output=JobOutput("hi", (5, 6), FinishReason.STOP),
)


def record_hash(**changes: bytes) -> dict[bytes, bytes]:
    fields = {
        str(name).encode(): str(value).encode() for name, value in zip(*[iter(RECORD.hset_fields())] * 2, strict=True)
    }
    fields.update({b"started_ms": b"11", b"first_token_ms": b"12", b"finished_ms": b"13", b"completion_tokens": b"2"})
    fields.update({b"attempts": b"1", b"worker": b"w1", b"output": encode_output(RECORD.output)})
    fields.update({name.encode(): value for name, value in changes.items()})
    return fields


def test_a_job_hash_round_trips():
    assert JobRecord.from_hash(record_hash()) == RECORD


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("status", b"bogus"),
        ("status", b""),
        ("status", b"\xff"),
        ("attempts", b"abc"),
        ("attempts", b"1.5"),
        ("attempts", b"-1"),
        ("attempts", b"9" * 5000),
        ("created_ms", b"soon"),
        ("prompt_tokens", b"\x00"),
        ("tenant", b"\xff\xfe"),
        ("output", b"\xc1"),
        ("output", msgpack.packb([1, 2])),
        ("output", msgpack.packb({"text": 5, "token_ids": [1], "finish_reason": "stop"})),
        ("output", msgpack.packb({"text": "hi", "token_ids": "abc", "finish_reason": "stop"})),
        ("output", msgpack.packb({"text": "hi", "token_ids": [-1], "finish_reason": "stop"})),
        ("output", msgpack.packb({"text": "hi", "token_ids": [1], "finish_reason": "tired"})),
        ("output", msgpack.packb({"text": "hi", "token_ids": [1]})),
    ],
)
def test_a_job_hash_field_that_cannot_be_read_is_refused_naming_it(field: str, value: bytes):
    with pytest.raises(SchemaError) as caught:
        JobRecord.from_hash(record_hash(**{field: value}))
    assert field in str(caught.value)


def test_fuzzed_job_hashes_decode_or_raise_schema_error():
    rng = random.Random(19)
    names = list(record_hash())
    odd = [b"", b"-1", b"0", b"1.5", b"abc", b"\xff", b"\x00", b"9" * 5000, b"queued", b"succeeded", b"\xc1"]
    odd += [msgpack.packb(v) for v in (None, 1, "x", [1], {"text": "t", "token_ids": [1], "finish_reason": "length"})]
    for _ in range(2000):
        changes = {name.decode(): rng.choice(odd) for name in rng.sample(names, rng.randint(1, 3))}
        try:
            JobRecord.from_hash(record_hash(**changes))
        except SchemaError as exc:
            assert any(name in str(exc) for name in changes), (changes, str(exc))


async def test_the_job_store_refuses_a_record_it_cannot_read_with_schema_error(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await aredis.set(keys.job("job_str"), "not a hash")  # another Redis type under a job's key
    await aredis.hset(keys.job("job_status"), mapping={"status": "bogus", "job_id": "job_status"})
    await aredis.hset(keys.job("job_attempts"), mapping={"status": "queued", "attempts": "many", "created_ms": 1})
    await aredis.hset(keys.job("job_created"), mapping={"status": "queued", "created_ms": "yesterday"})

    for job_id in ("job_str", "job_status", "job_attempts"):
        with pytest.raises(SchemaError):
            await store.start(job_id, "w1")
    for job_id in ("job_str", "job_status", "job_created"):
        with pytest.raises(SchemaError):
            await store.get(job_id)
    await aredis.hset(keys.job("job_ok"), mapping={"status": "queued", "created_ms": now_ms()})
    assert await store.start("job_ok", "w1") == (JobStatus.RUNNING, 1)
