"""bench.lora_profile launches every projection's LoRA kernels along its plan (GPU only)."""

from __future__ import annotations

import pytest

from bench.lora_profile import run_layer_kernels


@pytest.mark.gpu
def test_every_projection_runs_along_its_plan() -> None:
    lines = run_layer_kernels(num_tokens=32, adapters=8, repeats=1)
    assert [line.split(":")[0] for line in lines] == ["qkv", "o", "gate_up", "down"]
    assert all("shrink ShrinkConfig(" in line for line in lines)
