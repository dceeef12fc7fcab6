"""`--preload-adapters`: registered adapters read into their model's host cache before serving, so
their first requests make no disk read (real Redis registry, real engine and adapter pool)."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import torch
from redis.asyncio import Redis

from shared.adapter_registry import AdapterRecord, register_adapter
from shared.model_info import ModelInfo
from tests.engine.test_engine_generation import expected_tokens, greedy_request, make_engine, run_to_completion
from tests.engine.tiny_hf import TinyCheckpoint
from worker.adapter_pool.host_adapter import max_adapter_bytes
from worker.adapter_preload import preload_adapters
from worker.metrics import WorkerMetrics

TENANT = "acme"


async def register(redis: Redis, checkpoint: TinyCheckpoint, root: Path, name: str, model: ModelInfo) -> AdapterRecord:
    """`checkpoint`'s adapter `name`, copied under the tenant's directory of `root` and registered."""
    shutil.copytree(checkpoint.adapters[name], root / TENANT / name)
    return await register_adapter(
        redis,
        name=name,
        tenant=TENANT,
        model=model,
        adapter_root=root,
        path=f"{TENANT}/{name}",
        max_rank=16,
        max_bytes=1 << 30,
    )


def disk_loads(metrics: WorkerMetrics, model: str) -> float:
    return (
        metrics.registry.get_sample_value(
            "lorafleet_worker_adapter_load_seconds_count", {"model": model, "tier": "disk"}
        )
        or 0
    )


async def test_preloaded_adapters_serve_their_first_requests_without_a_disk_read(
    aredis: Redis, llama: TinyCheckpoint, tmp_path: Path
) -> None:
    records = [await register(aredis, llama, tmp_path, name, llama.info) for name in ("all_r8", "mlp_k_r4")]
    metrics = WorkerMetrics(device="cpu")
    engine = make_engine(llama, tmp_path, metrics=metrics, dtype="float32")
    assert await preload_adapters(aredis, ("all_r8", "mlp_k_r4"), {llama.info.name: engine}) == {llama.info.name: 2}
    assert all(record.ref().uid in engine.adapter_pool.host for record in records)
    assert disk_loads(metrics, llama.info.name) == 2
    request = dataclasses.replace(greedy_request(llama, "first", "all_r8"), adapter=records[0].ref())
    result = run_to_completion(engine, [request])["first"]
    assert list(result.output.token_ids) == expected_tokens(llama, "all_r8")
    assert disk_loads(metrics, llama.info.name) == 2  # served from the host tier


async def test_unknown_names_and_adapters_of_models_not_resident_are_skipped(
    aredis: Redis, llama: TinyCheckpoint, tmp_path: Path
) -> None:
    other_model = dataclasses.replace(llama.info, name="other")
    await register(aredis, llama, tmp_path, "mlp_k_r4", other_model)
    engine = make_engine(llama, tmp_path)
    assert await preload_adapters(aredis, ("missing", "mlp_k_r4"), {llama.info.name: engine}) == {}
    assert len(engine.adapter_pool.host) == 0


async def test_preloading_stops_when_the_host_cache_is_full_and_skips_a_failed_read(
    aredis: Redis, llama: TinyCheckpoint, tmp_path: Path
) -> None:
    names = ("attn_r4_rslora", "all_r8", "mlp_k_r4")
    records = [await register(aredis, llama, tmp_path, name, llama.info) for name in names]
    (tmp_path / TENANT / "attn_r4_rslora" / "adapter_model.safetensors").write_bytes(b"gone bad")
    largest = max_adapter_bytes(llama.info, max_rank=8, dtype=torch.float32)  # all_r8's size: one fits
    engine = make_engine(
        llama, tmp_path, dtype="float32", max_loras=1, adapter_host_cache_gb=(largest + 64) / (1 << 30)
    )
    assert await preload_adapters(aredis, names, {llama.info.name: engine}) == {llama.info.name: 1}
    assert engine.adapter_pool.host.resident == [records[1].ref().uid]  # the bad one skipped, then no room


async def test_the_room_goes_in_order_when_a_later_read_carves_first(
    aredis: Redis, llama: TinyCheckpoint, tmp_path: Path
) -> None:
    # the reads run in parallel: hold the first one back until the second has carved the only section
    names = ("all_r8", "mlp_k_r4")
    records = [await register(aredis, llama, tmp_path, name, llama.info) for name in names]
    largest = max_adapter_bytes(llama.info, max_rank=8, dtype=torch.float32)
    engine = make_engine(
        llama, tmp_path, dtype="float32", max_loras=1, adapter_host_cache_gb=(largest + 64) / (1 << 30)
    )
    pool = engine.adapter_pool
    second_read = threading.Event()
    read = pool._read

    def first_read_last(ref, *args):
        if ref.uid == records[0].ref().uid and not second_read.is_set():
            assert second_read.wait(10)
        try:
            return read(ref, *args)
        finally:
            if ref.uid == records[1].ref().uid:
                second_read.set()

    pool._read = first_read_last
    assert await preload_adapters(aredis, names, {llama.info.name: engine}) == {llama.info.name: 1}
    assert pool.host.resident == [records[0].ref().uid]  # the first named, not the first to carve
    assert pool.arena.allocator.bookkeeping_size() == len(pool.host) == 1  # the second's block given back
