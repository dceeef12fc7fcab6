"""bench.moe's roofline (the rows themselves need a GPU): a decode step's base-weight bytes, fp8 experts
at one byte a weight and a float32 scale a row."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.moe import QWEN3_30B_A3B, moe_roofline, step_weight_bytes
from shared.config import EngineConfig
from worker.memory_plan import model_footprint

FP8 = QWEN3_30B_A3B.served(quantization="fp8", kv_cache_dtype="auto", source=Path("qwen3-30b-a3b"))


@pytest.mark.parametrize("info", [QWEN3_30B_A3B, FP8], ids=["bf16", "fp8"])
def test_a_step_routing_to_every_expert_reads_every_weight_but_the_embedding(info) -> None:
    """Counted apart from the model: its tensors on the meta device, less the embedding table (a step
    reads a few rows of it), a few hundred bytes of rotary frequencies aside."""
    footprint = model_footprint(info, EngineConfig(device="cuda", max_loras=0))
    embedding = 2 * info.vocab_size * info.hidden_size
    assert step_weight_bytes(info, 10**6) == pytest.approx(footprint.weights - embedding, abs=4096)


def test_fp8_experts_read_about_half_the_bytes_once_most_experts_are_active() -> None:
    def ratio(concurrency: int) -> float:
        return step_weight_bytes(FP8, concurrency) / step_weight_bytes(QWEN3_30B_A3B, concurrency)

    # concurrency 32 routes to ~112 of 128 experts a layer: the experts dominate, and halve
    assert 0.5 < ratio(32) < 0.53
    # one sequence touches 8 experts a layer: the bf16 lm_head (0.6 GB of 6.1) weighs more
    assert ratio(1) > 0.55
    assert moe_roofline(FP8, 8, 1900, 3e12) > moe_roofline(QWEN3_30B_A3B, 8, 1900, 3e12)
