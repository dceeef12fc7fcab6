"""A worker's start-up tune on a real GPU: a tiny model's plans tuned into the cache, looked up at
once, reused at the next start, and nothing started past the budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from kernels.lora.configs import config_file, plan_for, read_plans, set_plan_cache_dir
from shared.config import EngineConfig
from tests.worker.test_kernel_plans import model_info
from worker.kernel_plans import adapted_layer, ensure_tuned, plan_keys

pytestmark = pytest.mark.gpu

RANK = 16


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "kernel-plans"
    set_plan_cache_dir(None)


def engine(max_num_batched_tokens: int) -> EngineConfig:
    return EngineConfig(device="cuda", max_lora_rank=RANK, max_num_batched_tokens=max_num_batched_tokens)


def test_a_tiny_tune_is_looked_up_at_once_and_reused(tmp_path: Path, cache_dir: Path) -> None:
    info = model_info(tmp_path, "llama")
    with capture_logs() as logs:
        run = ensure_tuned(info, engine(max_num_batched_tokens=8), cache_dir, budget_s=100.0)
    assert run is not None and run.not_reached == ()
    assert [result.num_tokens for result in run.results] == [1, 8]
    assert [e["bucket"] for e in logs if e["event"] == "kernel_tune_progress"] == [1, 8]

    device = torch.cuda.get_device_name()
    keys = plan_keys(adapted_layer(info, RANK), RANK)
    assert set(read_plans(config_file(device, cache_dir))) == {(key, b) for key in keys for b in (1, 8)}
    for result in run.results:
        for key, plan in zip(keys, result.plans, strict=True):
            assert plan_for(device, *key, result.num_tokens) == plan
    assert [plan_for(device, *key, 5) for key in keys] == list(run.results[1].plans)  # bucket 8 holds T=5

    assert ensure_tuned(info, engine(max_num_batched_tokens=8), cache_dir, budget_s=100.0) is None


def test_the_next_start_tunes_only_what_the_last_one_left(tmp_path: Path, cache_dir: Path) -> None:
    info = model_info(tmp_path, "llama")
    first = ensure_tuned(info, engine(max_num_batched_tokens=1), cache_dir, budget_s=100.0)
    assert first is not None and [r.num_tokens for r in first.results] == [1]
    second = ensure_tuned(info, engine(max_num_batched_tokens=8), cache_dir, budget_s=100.0)
    assert second is not None and [r.num_tokens for r in second.results] == [8]


def test_a_spent_budget_tunes_nothing_and_writes_nothing(tmp_path: Path, cache_dir: Path) -> None:
    info = model_info(tmp_path, "llama")
    run = ensure_tuned(info, engine(max_num_batched_tokens=8), cache_dir, budget_s=1e-6)
    assert run is not None and (run.results, run.not_reached) == ((), (1, 8))
    assert not config_file(torch.cuda.get_device_name(), cache_dir).exists()
