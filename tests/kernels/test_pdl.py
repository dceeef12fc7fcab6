"""When the decoder's kernels launch with programmatic dependent launch (kernels/pdl.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl


def test_cpu_tensors_never_launch_with_pdl():
    assert not pdl.enabled(torch.device("cpu"), 1)


def test_the_interpreter_never_launches_with_pdl(monkeypatch: pytest.MonkeyPatch):
    # it runs CUDA tensors' kernels on the host and has no grid dependency control
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0), 1)


def test_past_decode_sizes_kernels_launch_without_pdl(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pdl.enabled(torch.device("cuda", 0), pdl.MAX_ROWS + 1)


@pytest.mark.gpu
def test_hopper_and_later_launch_decode_sizes_with_pdl(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda", 0)
    assert pdl.enabled(device, pdl.MAX_ROWS) == (torch.cuda.get_device_capability(device) >= (9, 0))
