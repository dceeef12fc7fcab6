"""A worker whose sizes cannot fit its GPU stops at start with one line naming the setting to turn:
no model load, no out-of-memory traceback (the plan itself is tested on the CPU: tests/worker/test_memory_plan.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.cli.conftest import DemoFiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_lora_pool_larger_than_the_gpu_fails_at_start_naming_max_loras(demo_files: DemoFiles) -> None:
    command = [sys.executable, "-m", "cli", "worker", "--redis-url", "redis://127.0.0.1:1",
               "--model", f"demo={demo_files.model.path}", "--adapter-root", str(demo_files.adapter_root),
               "--device", "cuda", "--max-loras", "1000000", "--max-lora-rank", "64"]  # fmt: skip

    done = subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert done.returncode == 2, done.stderr
    assert "error: demo does not fit on the device" in done.stderr
    assert "Lower --max-loras, --max-lora-rank" in done.stderr
    assert "Traceback" not in done.stderr
