"""Faults that concern one job: they fail (or skip) only that job, with a clear code, and the
worker and every other job go on."""

from __future__ import annotations

import asyncio
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from cli.demo_adapters import DEMO_ADAPTERS
from shared import keys
from shared.adapter_format import WEIGHTS_FILE
from shared.model_info import ModelInfo
from shared.model_registry import publish_model
from shared.schema import JobStatus
from tests.fleet import MODEL, Fleet, open_fleet

pytestmark = pytest.mark.slow

MAX_DELIVERIES = 3


def publish_demo_model(fleet: Fleet) -> None:
    """Publish the model as an earlier worker would have, so jobs can be queued before any worker runs."""
    info = ModelInfo.from_pretrained(MODEL, fleet.model_dir)
    tokenizer_json = (fleet.model_dir / "tokenizer.json").read_bytes()

    async def publish() -> None:
        async with aioredis.Redis.from_url(fleet.redis_url) as client:
            await publish_model(client, info, tokenizer_json)

    asyncio.run(publish())


def test_job_canceled_while_queued_never_starts(fleet: Fleet):
    publish_demo_model(fleet)
    fleet.start_gateway()
    [job_id] = fleet.submit([{"model": MODEL, "prompt": "never run me", "max_tokens": 4}])
    fleet.cancel(job_id)
    worker = fleet.start_worker("late")
    [control] = fleet.submit([{"model": MODEL, "prompt": "run me", "max_tokens": 4}])
    fleet.wait_finished([control], timeout_s=30)
    [record] = fleet.records([job_id])
    assert record.status is JobStatus.CANCELED
    assert record.attempts == 0 and not record.started_ms and record.output is None
    with fleet.redis() as client:
        assert client.xlen(keys.queue(MODEL)) == 0  # the worker acknowledged it without running it
    assert worker.poll() is None


def test_corrupt_adapter_fails_only_the_jobs_that_name_it(redis_url, demo_assets, tmp_path: Path):
    model_dir, adapter_root = demo_assets
    own_root = tmp_path / "adapters"
    shutil.copytree(adapter_root, own_root)
    with ExitStack() as stack:
        fleet = open_fleet(redis_url, (model_dir, own_root), tmp_path, stack)
        corrupt, healthy = DEMO_ADAPTERS[0], DEMO_ADAPTERS[1]
        (own_root / corrupt.path(MODEL) / WEIGHTS_FILE).write_bytes(b"\x00" * 64)  # damaged after registration
        fleet.start_gateway()
        worker = fleet.start_worker("w1")
        jobs = [
            {"model": MODEL, "prompt": "a", "max_tokens": 4, "adapter": corrupt.name},
            {"model": MODEL, "prompt": "b", "max_tokens": 4},
        ]
        bad, base = fleet.submit(jobs)
        [other] = fleet.submit_as(
            healthy.tenant, [{"model": MODEL, "prompt": "c", "max_tokens": 4, "adapter": healthy.name}]
        )
        records = {r.job_id: r for r in fleet.wait_finished([bad, base, other], timeout_s=60)}
        assert records[bad].status is JobStatus.FAILED
        assert records[bad].error.code == "adapter_load_failed"
        assert records[base].status is JobStatus.SUCCEEDED
        assert records[other].status is JobStatus.SUCCEEDED
        assert worker.poll() is None


def test_job_delivered_too_many_times_is_dead_lettered_and_failed(fleet: Fleet):
    publish_demo_model(fleet)
    fleet.start_gateway()
    [job_id] = fleet.submit([{"model": MODEL, "prompt": "poison", "max_tokens": 4}])
    with fleet.redis() as client:
        # as if MAX_DELIVERIES workers had died running it (the start script counts attempts)
        client.hset(keys.job(job_id), "attempts", MAX_DELIVERIES)
    fleet.start_worker("w1", "--max-deliveries", str(MAX_DELIVERIES))
    [record] = fleet.wait_finished([job_id], timeout_s=30)
    assert record.status is JobStatus.FAILED
    assert record.error.code == "worker_crashed"
    with fleet.redis() as client:
        dead = client.xrange(keys.DEAD_LETTER)
        assert len(dead) == 1 and dead[0][1][b"model"] == MODEL.encode()
        assert client.xlen(keys.queue(MODEL)) == 0
    time.sleep(0.5)
    assert fleet.records([job_id])[0].status is JobStatus.FAILED  # never retried again
