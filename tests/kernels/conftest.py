"""Kernel tests run the Triton kernels themselves: on a machine without CUDA, through the
interpreter, which must be chosen before any kernel module is imported (tests/conftest.py does the
same for the whole suite; this keeps `pytest tests/kernels --confcutdir=tests/kernels` working)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
