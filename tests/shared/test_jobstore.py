"""Job state transitions in a real Redis: one stored result whatever races happen."""

from __future__ import annotations

import msgpack
import pytest

from gateway.auto_pipeline import AutoPipeline
from shared import keys
from shared.job_events import end_record
from shared.jobstore import Finish, JobStore, now_ms
from shared.schema import (
    FinishReason,
    JobError,
    JobMessage,
    JobOutput,
    JobRecord,
    JobStatus,
    SamplingParams,
    SchemaError,
    TokenDelta,
    decode_job,
)


def new_job(job_id: str = "job_1", tenant: str = "acme") -> tuple[JobRecord, JobMessage]:
    record = JobRecord(
        job_id=job_id, status=JobStatus.QUEUED, tenant=tenant, model="m", adapter=None, created_ms=now_ms()
    )
    message = JobMessage(job_id=job_id, tenant=tenant, model="m", prompt_token_ids=(1, 2, 3), sampling=SamplingParams())
    return record, message


OUTPUT = JobOutput(text="hi", token_ids=(5, 6), finish_reason=FinishReason.STOP)


async def test_create_writes_the_record_and_one_queue_entry(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    record, message = new_job()
    assert await store.create(record, message) == ("job_1", True)
    assert (await store.get("job_1")).status is JobStatus.QUEUED
    entries = await aredis.xrange(keys.queue("m"))
    assert len(entries) == 1
    assert decode_job(entries[0][1][b"job"]) == message
    assert 0 < await aredis.ttl(keys.job("job_1")) <= 60


@pytest.mark.parametrize("batched", [False, True])
async def test_create_loads_its_script_again_after_a_flush(aredis, batched):
    store = JobStore(aredis, job_ttl_s=60, batched=AutoPipeline(aredis, timeout_s=5.0) if batched else None)
    assert await store.create(*new_job("job_1")) == ("job_1", True)
    await aredis.script_flush()  # as after a Redis restart
    assert await store.create(*new_job("job_2")) == ("job_2", True)
    assert await aredis.xlen(keys.queue("m")) == 2


async def test_repeated_idempotency_key_returns_the_first_job_and_queues_nothing(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    assert await store.create(*new_job("job_1"), idempotency_key="k") == ("job_1", True)
    assert await store.create(*new_job("job_2"), idempotency_key="k") == ("job_1", False)
    assert await aredis.xlen(keys.queue("m")) == 1
    assert await store.get("job_2") is None


async def test_start_then_finish_stores_the_result(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await store.create(*new_job())
    assert await store.start("job_1", "w1") == (JobStatus.RUNNING, 1)
    assert await store.finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT, completion_tokens=2, first_token_ms=now_ms())
    record = await store.get("job_1")
    assert record.status is JobStatus.SUCCEEDED
    assert record.output == OUTPUT
    assert record.worker == "w1" and record.attempts == 1
    assert record.started_ms and record.first_token_ms and record.finished_ms


async def test_second_finish_never_overwrites_the_first(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await store.create(*new_job())
    await store.start("job_1", "w1")
    assert await store.finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT)
    assert not await store.finish("job_1", JobStatus.FAILED, error=JobError("internal_error", "late duplicate"))
    assert (await store.get("job_1")).status is JobStatus.SUCCEEDED


async def test_canceled_job_is_not_started_and_its_result_is_dropped(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await store.create(*new_job())
    assert await store.cancel("job_1") is JobStatus.CANCELED
    assert (await store.start("job_1", "w1"))[0] is JobStatus.CANCELED
    assert not await store.finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT)
    assert await store.cancel("job_1") is JobStatus.CANCELED
    assert await store.cancel("nope") is None


async def test_redelivery_counts_attempts(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await store.create(*new_job())
    await store.start("job_1", "w1")
    assert await store.start("job_1", "w2") == (JobStatus.RUNNING, 2)


async def test_token_events_carry_text_token_and_offset_and_a_first_event_sets_the_streams_ttl(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await store.publish_tokens([TokenDelta("job_1", 5, "h", 0), TokenDelta("job_2", 7, "", 3)])
    await store.publish_tokens([TokenDelta("job_1", 6, "é", 1)])
    events = [fields for _, fields in await aredis.xrange(keys.job_events("job_1"))]
    assert events == [
        {b"type": b"token", b"text": b"h", b"token_ids": b"[5]", b"offset": b"0"},
        {b"type": b"token", b"text": "é".encode(), b"token_ids": b"[6]", b"offset": b"1"},
    ]
    assert 0 < await aredis.ttl(keys.job_events("job_1")) <= 60
    assert await aredis.ttl(keys.job_events("job_2")) == -1  # not its first event: its TTL was set before


async def test_a_token_whose_events_key_is_of_another_type_fails_alone(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await aredis.set(keys.job_events("job_2"), "not a stream")
    deltas = [TokenDelta("job_1", 5, "h", 0), TokenDelta("job_2", 7, "x", 0), TokenDelta("job_3", 9, "y", 0)]
    with pytest.raises(SchemaError, match="token events"):
        await store.publish_tokens(deltas)
    assert await aredis.xlen(keys.job_events("job_1")) == 1
    assert await aredis.xlen(keys.job_events("job_3")) == 1


async def test_a_steps_tokens_and_ends_are_written_in_order_in_one_round_trip(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    for job_id in ("job_1", "job_2", "job_3"):
        await store.create(*new_job(job_id))
        await store.start(job_id, "w1")
    [(_, [(entry_id, _)])] = await aredis.xread({keys.queue("m"): "0-0"}, count=1)
    await aredis.xgroup_create(keys.queue("m"), keys.WORKER_GROUP, id="0")
    await aredis.xreadgroup(keys.WORKER_GROUP, "w1", {keys.queue("m"): ">"}, count=1)
    await store.cancel("job_3")
    deltas = [TokenDelta("job_1", 5, "h", 0), TokenDelta("job_2", 7, "x", 0)]
    endings = [
        Finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT, completion_tokens=2, entry=(keys.queue("m"), entry_id)),
        Finish("job_3", JobStatus.SUCCEEDED, output=OUTPUT, completion_tokens=2),  # canceled meanwhile
    ]
    await aredis.script_flush()  # as after a Redis restart: the ends are stored all the same
    done = await store.publish_step(deltas, endings)
    assert done.tokens_error is None and done.stored == [True, False]
    events = [fields[b"type"] for _, fields in await aredis.xrange(keys.job_events("job_1"))]
    assert events == [b"token", b"end"]  # the token first
    assert (await store.get("job_1")).status is JobStatus.SUCCEEDED
    assert (await store.get("job_3")).status is JobStatus.CANCELED
    assert await aredis.xlen(keys.job_events("job_2")) == 1
    assert await aredis.xlen(keys.queue("m")) == 2  # job_1's entry acknowledged and deleted with its result


async def test_a_step_whose_job_record_is_unwritable_reports_it_and_stores_the_others(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    for job_id in ("job_1", "job_2"):
        await store.create(*new_job(job_id))
        await store.start(job_id, "w1")
    await aredis.set(keys.job_events("job_2"), "not a stream")
    deltas = [TokenDelta("job_2", 7, "x", 0)]
    endings = [Finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT), Finish("job_2", JobStatus.SUCCEEDED, output=OUTPUT)]
    done = await store.publish_step(deltas, endings)
    assert isinstance(done.tokens_error, SchemaError)
    assert done.stored[0] is True and isinstance(done.stored[1], SchemaError)
    assert (await store.get("job_1")).status is JobStatus.SUCCEEDED
    assert (await store.get("job_2")).status is JobStatus.RUNNING


async def test_a_finished_jobs_end_event_carries_its_final_record_and_a_cancels_none(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    for job_id in ("job_1", "job_2"):
        await store.create(*new_job(job_id))
    await store.start("job_1", "w1")
    await store.finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT, completion_tokens=2, first_token_ms=now_ms())
    await store.cancel("job_2")
    [(_, finished)] = await aredis.xrange(keys.job_events("job_1"))
    assert end_record(finished) == await store.get("job_1")
    [(_, canceled)] = await aredis.xrange(keys.job_events("job_2"))
    assert canceled[b"type"] == b"end" and end_record(canceled) is None


def test_an_end_event_whose_record_is_no_record_is_a_schema_error():
    with pytest.raises(SchemaError, match="not msgpack"):
        end_record({b"type": b"end", b"record": b"\xc1"})
    with pytest.raises(SchemaError, match="field, value pairs"):
        end_record({b"type": b"end", b"record": msgpack.packb([b"status"])})
