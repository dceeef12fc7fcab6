"""The switching loop against a real Redis, real tiny checkpoints, a real engine thread: it switches
to a model whose jobs wait, and a model that cannot load leaves the worker serving what it had."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from cli.demo_model import write_demo_model
from shared import keys
from shared.config import EngineConfig, ModelSpec, WorkerConfig
from worker.engine_thread import EngineThread
from worker.metrics import WorkerMetrics
from worker.routed_streams import RoutedStreams
from worker.switching.residency import ModelResidency
from worker.switching.switcher import ModelSwitcher

WORKER = "w1"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    (root / "good").mkdir()
    write_demo_model(root / "good")
    shutil.copytree(root / "good", root / "other")
    shutil.copytree(root / "good", root / "broken")
    (root / "broken" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    return {name: root / name for name in ("good", "other", "broken")}


@pytest.fixture
async def switcher(model_dirs: dict[str, Path], aredis: Redis) -> AsyncIterator[ModelSwitcher]:
    config = WorkerConfig(
        redis_url="redis://unused",
        models=tuple(ModelSpec(name, path) for name, path in model_dirs.items()),
        adapter_root=model_dirs["good"],
        engine=EngineConfig(device="cpu", max_num_seqs=4, num_kv_blocks=64, max_loras=1, max_lora_rank=8),
        max_resident_models=1,
        cpu_model_cache_bytes=1 << 30,
    )
    residency = ModelResidency(config, WorkerMetrics("cpu"))
    residency.activate(residency.prepare("good"))
    thread = EngineThread(residency.engines, on_output=lambda _: None, on_crash=lambda exc: None)
    thread.start()

    async def hand_back(model: str) -> int:
        return 0

    switcher = ModelSwitcher(
        residency,
        thread,
        aredis,
        claim_idle_ms=60_000,
        switch_grace_s=1.0,
        in_flight=lambda model: (0, 0.0),
        hand_back=hand_back,
        release_routed=RoutedStreams(aredis, WORKER).hand_over_own,
    )
    task = asyncio.create_task(switcher.run())
    yield switcher
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.to_thread(thread.stop)


async def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_waiting_jobs_for_another_model_switch_an_idle_worker_to_it(switcher: ModelSwitcher, aredis) -> None:
    assert switcher.readable() == ["good"]
    await RoutedStreams(aredis, WORKER).register("good")
    await aredis.xadd(keys.worker_queue("good", WORKER), {"job": b"routed"})  # routed here, not read yet
    for _ in range(4):  # more waiting than the routed job the probe counts for "good"
        await aredis.xadd(keys.queue("other"), {"job": b"x"})
    await wait_for(lambda: switcher.switches == 1)
    assert switcher.residency.resident == ("other",) and switcher.readable() == ["other"]
    record = switcher.last_switch
    assert (record.incoming, record.outgoing, record.overlapped, record.handed_back) == ("other", "good", True, 0)
    assert "good" in switcher.report()["warm"]
    # the outgoing model's routed job went where a worker serving it reads
    assert [fields[b"job"] for _, fields in await aredis.xrange(keys.queue("good"))] == [b"routed"]
    assert not await aredis.exists(keys.worker_queue("good", WORKER))


async def test_a_model_that_cannot_load_leaves_the_resident_one_serving(switcher: ModelSwitcher, aredis) -> None:
    await aredis.xadd(keys.queue("broken"), {"job": b"x"})
    await wait_for(lambda: "broken" in switcher._failed_at)
    assert switcher.switches == 0
    assert switcher.residency.resident == ("good",) and switcher.admitting("good")
