"""A job's events stream (`lf:out:{id}`): how much of it is kept, and the final record its end event carries."""

from __future__ import annotations

import msgpack

from shared.schema import JobRecord, SchemaError

# Events kept per job stream (approximately): a streaming reader further behind than this misses
# token events; the offsets in the rest (and the final record) let it notice and recover the text.
EVENTS_CAP = 1000


def end_record(fields: dict[bytes, bytes]) -> JobRecord | None:
    """The final record an `end` event carries (the finish script writes it in; a cancel's end, or one
    a worker of an earlier release wrote, carries none: None, read the record). SchemaError when it is
    no record."""
    blob = fields.get(b"record")
    if blob is None:
        return None
    try:
        flat = msgpack.unpackb(blob, raw=True)  # Lua's strings come as msgpack strings: bytes, as a hash reads
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SchemaError(f"the end event's record is not msgpack: {exc}") from exc
    if not isinstance(flat, list) or len(flat) % 2 or not all(isinstance(item, bytes) for item in flat):
        raise SchemaError("the end event's record is not a list of field, value pairs")
    return JobRecord.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))
