"""Resident, warm and cold tiers of a worker's models, moved by ModelResidency (real tiny HF checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from cli.demo_model import write_demo_model
from shared.config import EngineConfig, ModelSpec, WorkerConfig
from worker.engine.engine import LLMEngine
from worker.engine.model_runner import ModelRunner
from worker.models.residency import ModelResidency


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

    def new_engine(name: str, runner: ModelRunner, tokenizer: Tokenizer) -> LLMEngine:
        return LLMEngine(runner, tokenizer, config.engine, config.adapter_root)

    return ModelResidency(config, new_engine)


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
    for (name, tensor), other in zip(cold.model.state_dict().items(), warm.model.state_dict().values(), strict=True):
        assert torch.equal(tensor, other), name


def test_without_a_host_cache_every_load_is_cold(model_dir: Path) -> None:
    models = residency(model_dir, "cpu", cache_bytes=0)
    models.activate(models.prepare("a"))
    models.evict("a")
    assert models.tiers()["cold"] == ["a", "b"]
    assert models.prepare("a").read_s > 0


def test_evicting_a_model_with_unfinished_requests_is_refused(model_dir: Path) -> None:
    from shared.schema import SamplingParams
    from worker.engine.engine import EngineRequest

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
