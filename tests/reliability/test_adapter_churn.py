"""10,000 adapter load/evict cycles leave the slot bookkeeping and the model's slot weights as they
found them: no growth in Python objects or traced memory."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

from cli.demo_adapters import DEMO_ADAPTERS, write_demo_adapter
from cli.demo_model import DemoModelShape, write_demo_model
from shared.config import EngineConfig, ModelSpec
from shared.model_info import ModelInfo
from worker.engine.adapter_slots import AdapterSlots
from worker.engine.model_runner import ModelRunner
from worker.engine.peft_adapter import load_adapter_weights

CYCLES = 10_000
SLOTS = 2
TINY = DemoModelShape(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-layer demo-shaped model and the demo adapters for it."""
    root = tmp_path_factory.mktemp("tiny")
    model_dir, adapter_root = root / "model", root / "adapters"
    model_dir.mkdir()
    write_demo_model(model_dir, TINY)
    info = ModelInfo.from_pretrained("tiny", model_dir)
    for adapter in DEMO_ADAPTERS:
        (adapter_root / adapter.path).mkdir(parents=True)
        write_demo_adapter(adapter_root / adapter.path, adapter, info, model_dir)
    return model_dir, adapter_root


def test_adapter_load_evict_cycles_do_not_grow_memory(tiny_assets: tuple[Path, Path]):
    model_dir, adapter_root = tiny_assets
    config = EngineConfig(device="cpu", max_loras=SLOTS, num_kv_blocks=4)
    runner = ModelRunner(ModelSpec("tiny", model_dir), config)
    info = ModelInfo.from_pretrained("tiny", model_dir)
    weights = [
        load_adapter_weights(adapter_root / a.path, info, max_rank=config.max_lora_rank, max_bytes=1 << 30)
        for a in DEMO_ADAPTERS
    ]
    slots = AdapterSlots(SLOTS)

    def cycle(index: int) -> None:
        uid = f"adapter-{index}"  # a new identity every time: nothing may be kept per uid once evicted
        grant = slots.acquire(uid)
        assert grant is not None and grant.needs_load
        if grant.evicted_uid is not None:
            runner.model.clear_adapter_slot(grant.slot)
        runner.model.set_adapter_slot(grant.slot, weights[index % len(weights)])
        slots.release(uid)

    for index in range(200):  # warm up: caches, allocator pools
        cycle(index)
    gc.collect()
    objects_before = len(gc.get_objects())
    tracemalloc.start()
    traced_before, _ = tracemalloc.get_traced_memory()

    for index in range(200, 200 + CYCLES):
        cycle(index)

    gc.collect()
    traced_after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    objects_after = len(gc.get_objects())
    assert len(slots.resident) == SLOTS
    assert objects_after - objects_before < 100, (objects_before, objects_after)
    assert traced_after - traced_before < 64 * 1024, (traced_before, traced_after)  # < 7 bytes a cycle
