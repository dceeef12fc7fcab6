"""Resident, warm and cold tiers of a worker's models, moved by ModelResidency (real tiny HF checkpoints)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from cli.demo_model import write_demo_model
from shared.config import EngineConfig, ModelSpec, WorkerConfig
from shared.schema import SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest
from worker.metrics import WorkerMetrics
from worker.switching.residency import ModelResidency
from worker.switching.shard_reader import CheckpointReadError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo")
    write_demo_model(directory)
    return directory


def residency(model_dir: Path, device: str, *, cache_bytes: int = 1 << 30, resident: int = 1) -> ModelResidency:
    config = WorkerConfig(
        redis_url="redis://unused",
        models=(ModelSpec("a", model_dir), ModelSpec("b", model_dir)),
        adapter_root=model_dir,
        engine=EngineConfig(device=device, max_num_seqs=4, num_kv_blocks=64, max_loras=1, max_lora_rank=8),
        max_resident_models=resident,
        cpu_model_cache_bytes=cache_bytes,
    )
    return ModelResidency(config, WorkerMetrics(device))


def test_models_move_between_resident_warm_and_cold(model_dir: Path) -> None:
    models = residency(model_dir, "cpu")
    assert models.slots == 1
    assert models.tiers() == {"resident": [], "warm": [], "cold": ["a", "b"]}
    cold_cost = models.switch_cost_s("a")
    models.activate(models.prepare("a"))
    assert models.tiers() == {"resident": ["a"], "warm": [], "cold": ["b"]}
    models.evict("a")
    assert models.tiers() == {"resident": [], "warm": ["a"], "cold": ["b"]}
    assert models.switch_cost_s("a") < cold_cost  # warm: no disk read in the estimate
    models.activate(models.prepare("b"))
    assert models.resident == ("b",) and "a" in models.tiers()["warm"]


def test_a_warm_model_is_filled_from_the_host_cache_with_the_same_weights(model_dir: Path) -> None:
    models = residency(model_dir, "cpu")
    cold = models.prepare("a")
    warm = models.prepare("a")
    assert cold.read_s > 0 and warm.read_s == 0
    warm_weights = warm.runner.model.state_dict().values()
    for (name, tensor), other in zip(cold.runner.model.state_dict().items(), warm_weights, strict=True):
        assert torch.equal(tensor, other), name


def test_without_a_host_cache_every_load_is_cold(model_dir: Path) -> None:
    models = residency(model_dir, "cpu", cache_bytes=0)
    models.activate(models.prepare("a"))
    models.evict("a")
    assert models.tiers()["cold"] == ["a", "b"]
    assert models.prepare("a").read_s > 0


def test_a_disk_error_fails_that_cold_load_alone(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = residency(model_dir, "cpu", cache_bytes=0)  # streamed from disk to the model
    engine = models.activate(models.prepare("a"))

    def disk_error(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", disk_error)
        with pytest.raises(CheckpointReadError, match=r"model\.safetensors: read failed"):
            models.prepare("b")
    assert models.resident == ("a",) and models.engines["a"] is engine
    models.evict("a")
    models.activate(models.prepare("b"))  # the next load of it, the disk healthy again
    assert models.resident == ("b",)


def test_evicting_a_model_with_unfinished_requests_is_refused(model_dir: Path) -> None:
    models = residency(model_dir, "cpu")
    engine = models.activate(models.prepare("a"))
    engine.add(EngineRequest("j", (5, 6, 7), SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="unfinished"):
        models.evict("a")
    assert models.resident == ("a",)


def test_warm_up_reads_a_cold_model_into_the_cache_only_if_it_fits(model_dir: Path) -> None:
    models = residency(model_dir, "cpu", cache_bytes=(model_dir / "model.safetensors").stat().st_size)
    models.warm_up("a")
    models.warm_up("b")  # no room left beside a
    assert models.tiers() == {"resident": [], "warm": ["a"], "cold": ["b"]}


@pytest.mark.gpu
def test_on_cuda_evicting_gives_the_device_memory_back(model_dir: Path) -> None:
    models = residency(model_dir, "cuda")
    models.activate(models.prepare("a"))
    models.evict("a")  # the first model leaves process-wide state behind (cuBLAS workspaces)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    models.activate(models.prepare("b"))
    assert torch.cuda.memory_allocated() > baseline
    assert models.fits_beside_resident("a")
    models.evict("b")
    assert torch.cuda.memory_allocated() == baseline  # no switch leaks device memory
    assert all(t.is_pinned() for t in models.cache.get("b").tensors.values())


def _greedy_outputs(engine: LLMEngine, prompts: list[tuple[int, ...]], *, tag: str) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(EngineRequest(f"{tag}-{i}", prompt, params))
    results = {}
    while engine.num_unfinished:
        for result in engine.step():
            results[result.job_id] = tuple(result.output.token_ids)
    return [results[f"{tag}-{i}"] for i in range(len(prompts))]


PROMPTS = [(5, 6, 7, 8, 9), (11, 3, 4), tuple(range(20, 60))]


def fresh_engine(models: ModelResidency) -> LLMEngine:
    """Model b's engine as a worker starting with it would build it."""
    fresh = ModelResidency(models.config, WorkerMetrics(models.config.engine.device))
    return fresh.activate(fresh.prepare("b"))


def test_a_model_prepared_to_replace_another_takes_its_kv_storage_and_serves_as_a_fresh_engine_would(
    model_dir: Path,
) -> None:
    models = residency(model_dir, "cpu")
    serving = models.activate(models.prepare("a"))
    before = _greedy_outputs(serving, PROMPTS, tag="a")  # the storage now holds a's K/V
    prepared = models.prepare("b", replacing="a")
    assert prepared.runner.kv_cache.key[0].data_ptr() == serving.runner.kv_cache.key[0].data_ptr()
    assert _greedy_outputs(serving, PROMPTS, tag="a-again") == before  # a serves on beside it, untouched
    models.evict("a")
    incoming = models.activate(prepared)
    assert _greedy_outputs(incoming, PROMPTS, tag="b") == _greedy_outputs(fresh_engine(models), PROMPTS, tag="fresh")


def test_an_evicted_models_kv_storage_is_reused_by_the_next_one(model_dir: Path) -> None:
    models = residency(model_dir, "cpu")
    first = models.activate(models.prepare("a")).runner.kv_cache.key[0].data_ptr()
    models.evict("a")
    second = models.activate(models.prepare("b")).runner.kv_cache.key[0].data_ptr()
    assert second == first


@pytest.mark.gpu
def test_on_cuda_a_model_is_prepared_and_its_graphs_captured_while_the_one_it_replaces_serves(
    model_dir: Path,
) -> None:
    """The overlapped switch: b's weights copied and its decode graphs captured over a's KV storage
    on a loader thread while a decodes on this one; a's tokens are unchanged by it, and b then serves
    (decoding through the graphs captured beside a) exactly as a fresh engine does."""
    models = residency(model_dir, "cuda")
    serving = models.activate(models.prepare("a"))
    long_prompts = PROMPTS * 8  # enough decoding to last through the preparation
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    def decode_all(tag: str, *, while_alive: threading.Thread | None = None) -> list[tuple[int, ...]]:
        for i, prompt in enumerate(long_prompts):
            serving.add(EngineRequest(f"{tag}-{i}", prompt, params))
        done = {}
        while serving.num_unfinished or (while_alive is not None and while_alive.is_alive()):
            done |= {r.job_id: tuple(r.output.token_ids) for r in serving.step()}
        return [done[f"{tag}-{i}"] for i in range(len(long_prompts))]

    alone = decode_all("alone")
    prepared: list = []
    loader = threading.Thread(target=lambda: prepared.append(models.prepare("b", replacing="a")))
    loader.start()
    beside = decode_all("beside", while_alive=loader)
    loader.join()
    assert prepared and prepared[0].runner.graphs is not None
    assert beside == alone
    models.evict("a")
    incoming = models.activate(prepared[0])
    assert _greedy_outputs(incoming, PROMPTS, tag="b") == _greedy_outputs(fresh_engine(models), PROMPTS, tag="fresh")
