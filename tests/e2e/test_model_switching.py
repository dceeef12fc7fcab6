"""One CPU worker serving two base models with room for one resident: traffic shifts between them,
the worker switches back and forth (recorded in its heartbeat), and every job succeeds."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from cli.demo_adapters import DEMO_ADAPTERS
from shared import keys
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.schema import JobStatus
from tests.e2e.processes import wait_until
from tests.fleet import MODEL, TENANT, Fleet

pytestmark = pytest.mark.slow

SECOND = "demo-b"  # the demo checkpoint served under a second name: a second base model to the fleet
SECOND_ADAPTER = f"{DEMO_ADAPTERS[0].name}-b"


def register_second_adapter(fleet: Fleet) -> None:
    async def run() -> None:
        async with aioredis.Redis.from_url(fleet.redis_url) as client:
            await register_adapter(
                client,
                name=SECOND_ADAPTER,
                tenant=TENANT,
                model=ModelInfo.from_pretrained(SECOND, fleet.model_dir),
                adapter_root=fleet.adapter_root,
                path=DEMO_ADAPTERS[0].path("demo"),
                max_rank=64,
                max_bytes=1 << 30,
            )

    asyncio.run(run())


def jobs(model: str, adapter: str, count: int) -> list[dict]:
    prompts = ["Once upon a time", "The quick brown fox", "In the beginning"]
    return [
        {"model": model, "prompt": prompts[i % 3], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        | ({"adapter": adapter} if i % 2 else {})
        for i in range(count)
    ]


def heartbeat(fleet: Fleet, worker: str) -> dict[str, object]:
    with fleet.redis() as client:
        raw = client.hgetall(keys.worker(worker))
    return {key.decode(): json.loads(value) for key, value in raw.items() if key.decode() != "device"}


def test_traffic_shifting_between_two_models_switches_the_worker_and_every_job_succeeds(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker(
        "w1",
        "--model", f"{SECOND}={fleet.model_dir}",
        "--max-resident-models", "1", "--cpu-model-cache-gb", "0.5", "--switch-grace", "5",
    )  # fmt: skip
    register_second_adapter(fleet)
    first = heartbeat(fleet, "w1")
    assert first["models"] == [MODEL, SECOND]
    assert first["resident"] == [MODEL] and first["switches"] == 0

    all_ids: list[str] = []
    for phase in ([(MODEL, DEMO_ADAPTERS[0].name)], [(SECOND, SECOND_ADAPTER)], [(MODEL, ""), (SECOND, "")]):
        batch = [job for model, adapter in phase for job in jobs(model, adapter or DEMO_ADAPTERS[0].name, 8)]
        for job in batch:
            if job["model"] == SECOND and job.get("adapter") == DEMO_ADAPTERS[0].name:
                job["adapter"] = SECOND_ADAPTER
        ids = fleet.submit(batch)
        records = fleet.wait_finished(ids, timeout_s=120)
        failed = [(r.job_id, r.status, r.error) for r in records if r.status is not JobStatus.SUCCEEDED]
        assert not failed, failed
        all_ids += ids

    # demo → demo-b for the second phase, and at least once more in the third; the heartbeat is
    # published every 2 s, so a switch made as the last jobs finished may not be in it yet
    wait_until(
        lambda: heartbeat(fleet, "w1")["switches"] >= 2,
        timeout_s=30,
        what="the heartbeat to report the third phase's switch",
        logs=[fleet.log_of("w1")],
    )
    beat = heartbeat(fleet, "w1")
    assert len(beat["resident"]) == 1 and sorted(beat["resident"] + beat["warm"]) == [MODEL, SECOND]
    assert beat["cold"] == []
    last = beat["last_switch"]
    assert last["outgoing"] in (MODEL, SECOND) and last["incoming"] != last["outgoing"] and last["pause_s"] >= 0
    for record in fleet.records(all_ids):
        assert record.completion_tokens == 6 and fleet.end_events(record.job_id) == 1
    with fleet.redis() as client:
        for model in (MODEL, SECOND):
            assert client.xlen(keys.queue(model)) == 0
        assert client.xlen(keys.DEAD_LETTER) == 0
    log = fleet.log_of("w1").read_text()
    assert log.count("model_switched") == beat["switches"]
    # switching is ordinary work: nothing in it is logged as an error (its routed streams, handed over at
    # each switch, come back without their group and are regrouped quietly)
    errors = [line for line in log.splitlines() if '"level":"error"' in line]
    assert not errors, errors[:3]


def test_a_switch_past_its_grace_hands_running_jobs_back_and_they_still_succeed(fleet: Fleet) -> None:
    fleet.start_gateway()
    fleet.start_worker(
        "w1",
        "--model", f"{SECOND}={fleet.model_dir}",
        "--max-resident-models", "1", "--cpu-model-cache-gb", "0.5", "--switch-grace", "0",
    )  # fmt: skip
    long_jobs = [job | {"max_tokens": 400} for job in jobs(MODEL, DEMO_ADAPTERS[0].name, 4)]
    long_ids = fleet.submit(long_jobs)
    wait_until(lambda: fleet.running_on("w1", long_ids) == 4, timeout_s=30, what="the long jobs to start")
    # a burst on the other model: its pressure soon outweighs the long jobs' (4 running, young)
    short_ids = fleet.submit([job for job in jobs(SECOND, "", 16) if "adapter" not in job] * 2)
    records = fleet.wait_finished(long_ids + short_ids, timeout_s=180)
    assert all(r.status is JobStatus.SUCCEEDED for r in records), [(r.job_id, r.status, r.error) for r in records]
    assert all(r.completion_tokens == 400 for r in records[:4])
    assert all(r.attempts == 1 for r in records[:4])  # a hand-back does not count as a delivery
    log = fleet.log_of("w1").read_text()
    logged = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(line.get("handed_back") == 4 for line in logged) and log.count("job_handed_back") >= 4
    # and no thrashing: over to the burst, back for the handed-back jobs once the burst is served
    assert 2 <= heartbeat(fleet, "w1")["switches"] <= 4  # 2 here; a slow machine may split the burst
