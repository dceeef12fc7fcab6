"""Job state transitions in a real Redis: one stored result whatever races happen."""

from __future__ import annotations

import pytest

from gateway.auto_pipeline import AutoPipeline
from shared import keys
from shared.jobstore import JobStore, now_ms
from shared.schema import (
    FinishReason,
    JobError,
    JobMessage,
    JobOutput,
    JobRecord,
    JobStatus,
    SamplingParams,
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
