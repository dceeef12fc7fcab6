"""Engines and models for tests, built the way a worker builds them: an engine through ModelResidency
(the memory plan, the checkpoint streamed from its files into the model, the runner, the engine), a
model alone by the same loader, and adapters by the adapter pool's own reader and slot writer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from shared.config import EngineConfig, ModelSpec, WorkerConfig
from shared.model_info import ModelInfo
from tests.engine.tiny_hf import saved_adapter_ref
from worker.adapter_pool.host_adapter import HostAdapter, fresh_buffers, read_host_adapter
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.engine import LLMEngine
from worker.metrics import WorkerMetrics
from worker.model.model import CausalLM
from worker.switching.loader import new_model, stream_to_model
from worker.switching.residency import ModelResidency
from worker.switching.shard_reader import StagingRing
from worker.tensor_parallel import Followers


def load_engine(
    model_dir: Path, adapter_root: Path, *, name: str = "tiny", metrics: WorkerMetrics | None = None, **engine: object
) -> LLMEngine:
    """The engine a worker serving `model_dir` as `name` runs, with EngineConfig(**engine); its
    series go to `metrics` (default: a registry of its own)."""
    config = WorkerConfig(
        redis_url="redis://unused",  # the residency never talks to Redis
        models=(ModelSpec(name, model_dir),),
        adapter_root=adapter_root,
        engine=EngineConfig(**engine),
    )
    residency = ModelResidency(config, metrics or WorkerMetrics(config.engine.device))
    return residency.activate(residency.prepare(name))


@contextlib.contextmanager
def tensor_parallel_engine(
    model_dir: Path, adapter_root: Path, *, name: str = "tiny", **engine: object
) -> Iterator[LLMEngine]:
    """`load_engine` of a tensor-parallel worker (EngineConfig(**engine).tensor_parallel ranks):
    this process is rank 0, the followers are started as a worker starts them, and stopped after."""
    config = WorkerConfig(
        redis_url="redis://unused",
        models=(ModelSpec(name, model_dir),),
        adapter_root=adapter_root,
        engine=EngineConfig(**engine),
    )
    followers = Followers(config)
    try:
        residency = ModelResidency(config, WorkerMetrics(config.engine.device), followers.channel)
        yield residency.activate(residency.prepare(name))
    finally:
        followers.stop(tell=True)


def load_model(
    model_dir: Path,
    info: ModelInfo,
    adapters: dict[int, Path] | None = None,
    *,
    max_loras: int = 4,
    max_lora_rank: int = 8,
    dtype: str | None = "float32",
    device: str = "cpu",
) -> CausalLM:
    """The model alone, loaded as a worker loads it (dtype None: the checkpoint's), with the PEFT
    adapter directory `adapters[slot]` written into each listed slot (pools of max rank <= 16: a slot
    is one page)."""
    config = EngineConfig(device=device, dtype=dtype, max_loras=max_loras, max_lora_rank=max_lora_rank)
    model = new_model(info, config)
    stream_to_model(model, info.name, model_dir, StagingRing(pin=False), None)
    write_adapters(model, {(slot,): directory for slot, directory in (adapters or {}).items()})
    return model


def host_adapter(directory: Path, model: CausalLM, *, max_rank: int | None = None) -> HostAdapter:
    """The saved PEFT adapter in `directory`, read for `model` by the adapter pool's reader."""
    return read_host_adapter(
        saved_adapter_ref(directory.name, directory),
        adapter_root=directory.parent,
        info=model.info,
        dtype=model.dtype,
        max_rank=max_rank or model.max_lora_rank,
        max_bytes=1 << 30,
        take=fresh_buffers(pin=model.slot_ranks.is_cuda),
    )


def write_adapters(model: CausalLM, adapters: dict[tuple[int, ...], Path], writer: SlotWriter | None = None) -> None:
    """Write each adapter directory into its pages (in rank order) with `writer` (default: a new one)."""
    writer = writer or SlotWriter(model)
    for pages, directory in adapters.items():
        writer.write(pages, host_adapter(directory, model)).wait()
    if model.slot_ranks.is_cuda:
        torch.cuda.synchronize()
