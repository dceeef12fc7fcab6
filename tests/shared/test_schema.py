"""The queue message's wire format: what round-trips, and how messages of another release decode."""

from __future__ import annotations

import msgpack
import pytest

from shared.schema import AdapterRef, JobMessage, SamplingParams, SchemaError, decode_job, encode_job

MESSAGE = JobMessage(
    job_id="job_1",
    tenant="acme",
    model="m",
    prompt_token_ids=(1, 2, 3),
    sampling=SamplingParams(max_tokens=4, temperature=0.5, seed=7, stop=("\n",)),
    adapter=AdapterRef("a", 2, "a/v2", "sha256-pieces-8MiB:" + "0" * 64),
    created_at=1.5,
    deadline=9.0,
    request_id="req-1",
    stream=True,
)


@pytest.mark.parametrize("stream", [True, False])
def test_a_message_round_trips(stream: bool):
    message = JobMessage(**{**{f: getattr(MESSAGE, f) for f in MESSAGE.__slots__}, "stream": stream})
    assert decode_job(encode_job(message)) == message


def test_a_message_from_before_the_stream_flag_is_streamed_as_it_was_then():
    fields = msgpack.unpackb(encode_job(MESSAGE))
    del fields["stream"]
    assert decode_job(msgpack.packb(fields)).stream is True


@pytest.mark.parametrize("version", [1, 3], ids=["a plain sha256 names the adapter", "unknown"])
def test_another_schema_version_is_refused(version: int):
    fields = msgpack.unpackb(encode_job(MESSAGE))
    with pytest.raises(SchemaError, match="version"):
        decode_job(msgpack.packb({**fields, "v": version}))
