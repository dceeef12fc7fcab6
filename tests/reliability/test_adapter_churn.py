"""10,000 adapter load/evict cycles through the adapter pool (disk → host cache → device slot) leave
it as they found it: no growth in pool entries, Python objects or the process's resident memory."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from cli.demo_adapters import DEMO_ADAPTERS, write_demo_adapter
from cli.demo_model import DemoModelShape, write_demo_model
from shared.adapter_digest import file_digest
from shared.adapter_format import WEIGHTS_FILE
from shared.model_info import ModelInfo
from shared.schema import AdapterRef
from tests.engine.engines import load_engine

CYCLES = 10_000
SLOTS = 2


def resident_bytes() -> int:
    """The process's resident set size (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
        (adapter_root / adapter.path("tiny")).mkdir(parents=True)
        write_demo_adapter(adapter_root / adapter.path("tiny"), adapter, info, model_dir)
    return model_dir, adapter_root


def test_adapter_load_evict_cycles_do_not_grow_memory(tiny_assets: tuple[Path, Path]):
    model_dir, adapter_root = tiny_assets
    # new identities every cycle: once the tiers are full, every cycle evicts from both
    engine = load_engine(model_dir, adapter_root, device="cpu", max_loras=SLOTS, max_lora_rank=16, num_kv_blocks=4)
    pool = engine.adapter_pool  # driven here without engine steps
    sources = [(a.path("tiny"), file_digest(adapter_root / a.path("tiny") / WEIGHTS_FILE)) for a in DEMO_ADAPTERS]

    def cycle(index: int) -> int:
        """One adapter through every tier; returns its host copy's size in bytes."""
        path, digest = sources[index % len(sources)]
        ref = AdapterRef(f"adapter-{index}", 1, path, digest)  # a new identity every time
        pool.request(ref)
        while pool.gpu.slot_of(ref.uid) is None:
            assert pool.poll() == []
            pool.wait(1.0)
        pool.gpu.acquire(ref.uid)
        pool.gpu.release(ref.uid)
        pool.drop(ref.uid)
        return pool.host.get(ref.uid).nbytes

    adapter_bytes = min(cycle(index) for index in range(200))  # warm up: allocator pools, loader threads
    gc.collect()
    objects_before = len(gc.get_objects())
    entries_before = pool.bookkeeping_size()
    rss_before = resident_bytes()

    for index in range(200, 200 + CYCLES):
        cycle(index)

    gc.collect()
    rss_growth = resident_bytes() - rss_before
    objects_after = len(gc.get_objects())
    pool.close()
    assert len(pool.gpu.resident) == SLOTS
    assert pool.bookkeeping_size() <= entries_before + 2, (entries_before, pool.bookkeeping_size())
    assert pool.host.nbytes <= pool.host.budget_bytes
    assert objects_after - objects_before < 100, (objects_before, objects_after)
    # keeping one host copy in ten would grow the process by CYCLES / 10 * adapter_bytes
    assert rss_growth < CYCLES // 10 * adapter_bytes, (rss_growth, adapter_bytes)
