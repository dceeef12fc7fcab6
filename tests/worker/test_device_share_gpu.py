"""A worker's GPU memory cap under MPS co-location (`--gpu-memory-fraction`), on a real GPU: the cap
holds for a plain "cuda" device as for "cuda:0". Each case runs in a child process, so the cap does
not bind the test process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

CHILD = """
import sys, torch
from shared.config import EngineConfig
from worker.device_share import apply_device_share
apply_device_share(EngineConfig(device=sys.argv[1], gpu_memory_fraction=0.05))
total = torch.cuda.get_device_properties(0).total_memory
small = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
try:
    torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    print("capped")
"""


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_the_memory_fraction_caps_this_process(device: str) -> None:
    child = subprocess.run([sys.executable, "-c", CHILD, device], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "capped"  # after the worker's own log line
