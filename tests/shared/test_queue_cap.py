"""The queue cap counts a class's streams of a model: interactive jobs over the shared stream and every
worker's routed stream, batch jobs over the shared batch stream alone (routing never places them)."""

from __future__ import annotations

import dataclasses

import pytest

from shared import keys
from shared.config import TenantLimits
from shared.jobstore import JobStore
from shared.rate_limits import Admission, AdmissionDenied
from shared.schema import Priority
from tests.shared.test_jobstore import new_job


async def create(store: JobStore, job_id: str, priority: Priority, queue: str | None = None) -> None:
    record, message = new_job(job_id)
    record = dataclasses.replace(record, priority=priority)
    message = dataclasses.replace(message, priority=priority)
    admission = Admission(TenantLimits(max_queue_per_model=2)).check("acme", "lookup", job_id, "m", priority, 10)
    await store.create(record, message, admission=admission, queue=queue)


async def test_routed_entries_count_against_the_interactive_cap_only(aredis):
    store = JobStore(aredis, job_ttl_s=60)
    await aredis.set(keys.api_key("lookup"), "acme")
    await create(store, "job_1", Priority.INTERACTIVE, queue=keys.worker_queue("m", "w1"))
    await create(store, "job_2", Priority.INTERACTIVE)

    with pytest.raises(AdmissionDenied) as refused:
        await create(store, "job_3", Priority.INTERACTIVE)
    assert refused.value.denial.limit == "queue"
    await create(store, "job_4", Priority.BATCH)
    await create(store, "job_5", Priority.BATCH)
    with pytest.raises(AdmissionDenied):
        await create(store, "job_6", Priority.BATCH)
    assert await aredis.xlen(keys.queue("m", Priority.BATCH)) == 2
    assert await aredis.sismember(keys.worker_queues("m"), keys.worker_queue("m", "w1"))
