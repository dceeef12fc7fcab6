"""Writes that wait for replicas (WAIT), on a real Redis that has none: a new job no replica confirms is
withdrawn whole, and a result is stored and acknowledged in one script whatever the wait says."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.auto_pipeline import AutoPipeline
from shared import keys
from shared.config import ReplicaWait, TenantLimits
from shared.jobstore import JobStore
from shared.jobstore_errors import ReplicaUnavailable
from shared.rate_limits import Admission
from shared.redis_client import resilient_redis
from shared.schema import JobStatus, Priority
from tests.shared.test_jobstore import OUTPUT, new_job

WAIT = ReplicaWait(replicas=1, timeout_ms=50)


@pytest.fixture
async def batched(redis_url):
    client = resilient_redis(redis_url, socket_timeout_s=None)
    yield AutoPipeline(client, timeout_s=5.0)
    await client.aclose()


@pytest.mark.parametrize("through_pipeline", [False, True])
async def test_a_job_no_replica_confirms_is_withdrawn_with_everything_it_wrote(aredis, batched, through_pipeline):
    store = JobStore(aredis, job_ttl_s=60, batched=batched if through_pipeline else None, replica_wait=WAIT)
    record, message = new_job()
    admission = Admission(TenantLimits()).check("acme", "lookup", record.job_id, "m", Priority.INTERACTIVE, 10)
    await aredis.set(keys.api_key("lookup"), "acme")
    started = time.monotonic()
    with pytest.raises(ReplicaUnavailable) as refused:
        await store.create(record, message, idempotency_key="k", admission=admission)
    assert refused.value.code == "replica_unavailable"
    assert time.monotonic() - started < 2.0  # bounded by the wait's timeout, not the client's retries
    assert await aredis.exists(keys.job(record.job_id), keys.idempotency("acme", "k")) == 0
    assert await aredis.xlen(keys.queue("m")) == 0
    assert await aredis.zcard(keys.active_jobs("acme")) == 0


async def test_concurrent_jobs_in_one_batch_share_one_wait_and_are_all_withdrawn(aredis, batched):
    store = JobStore(aredis, job_ttl_s=60, batched=batched, replica_wait=WAIT)
    jobs = [new_job(f"job_{index}") for index in range(20)]
    started = time.monotonic()
    outcomes = await asyncio.gather(*(store.create(*job) for job in jobs), return_exceptions=True)
    assert all(isinstance(outcome, ReplicaUnavailable) for outcome in outcomes)
    assert time.monotonic() - started < 2.0  # one WAIT for the batch, not one timeout per job
    assert await aredis.xlen(keys.queue("m")) == 0
    assert await aredis.exists(*(keys.job(record.job_id) for record, _ in jobs)) == 0


async def test_a_job_that_needs_no_replica_is_created_without_waiting(aredis, batched):
    store = JobStore(aredis, job_ttl_s=60, batched=batched, replica_wait=ReplicaWait(replicas=0))
    record, message = new_job()
    assert await store.create(record, message) == ("job_1", True)


@pytest.mark.parametrize("replica_wait", [ReplicaWait(replicas=0), WAIT])
async def test_a_result_and_its_ack_are_one_script(aredis, replica_wait):
    store = JobStore(aredis, job_ttl_s=60, replica_wait=replica_wait)
    await aredis.xgroup_create(keys.queue("m"), keys.WORKER_GROUP, id="0", mkstream=True)
    await JobStore(aredis, job_ttl_s=60).create(*new_job())
    [[_, [(entry_id, _)]]] = await aredis.xreadgroup(keys.WORKER_GROUP, "w1", {keys.queue("m"): ">"})
    await store.start("job_1", "w1")
    stored = await store.finish("job_1", JobStatus.SUCCEEDED, output=OUTPUT, entry=(keys.queue("m"), entry_id))
    assert stored  # stored although no replica confirmed it: a result is never thrown away
    assert (await store.get("job_1")).status is JobStatus.SUCCEEDED
    assert (await aredis.xpending(keys.queue("m"), keys.WORKER_GROUP))["pending"] == 0
    assert await aredis.xlen(keys.queue("m")) == 0
    # a second delivery's result is not stored again, and its ack is harmless
    assert not await store.finish("job_1", JobStatus.FAILED, entry=(keys.queue("m"), entry_id))
