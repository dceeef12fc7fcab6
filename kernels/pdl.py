"""Programmatic dependent launch (PDL, compute capability 9.0 and later) for the decoder layer's small
Triton kernels: the fused norm, RoPE + KV write and SiLU·up kernels, and paged attention.

Launched with PDL, a kernel is scheduled while the kernel before it on the stream is still finishing
and waits inside (`griddepcontrol.wait`) until that kernel has completed and its writes are visible;
it then lets the kernel after it be scheduled the same way. At decode sizes the gap between two
dependent launches is a sizeable part of a small kernel's time (what hiding it gains a decode step:
docs/benchmarks.md, "Engine"). The LoRA kernels are not launched this way: they run on the side stream
beside the base GEMM, and there PDL slowed the adapter rows.

The rule that keeps it correct: a kernel launched with `launch_pdl=True` calls `wait_for_previous`
before any other load or store, in every program (`launch_options` passes both flags together). Its
completion then implies its predecessor's, so ordering stays transitive along the stream whatever
the next kernel does.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Decode sizes. A decode-sized kernel runs for microseconds, so the launch gap PDL hides is a large part
# of it. Launched with PDL at every size it slowed Qwen3-MoE's prefill, for a cause not found
# (docs/benchmarks.md, "Figures behind code comments"); bounded here, prefill is as fast as without.
MAX_ROWS = 256


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device, rows: int) -> bool:
    """Whether a kernel over `rows` rows (tokens, or token-heads) on `device` launches with PDL: on CUDA
    devices of compute capability 9.0 or later, for up to MAX_ROWS rows, and never under the Triton
    interpreter (TRITON_INTERPRET=1, which runs CUDA tensors' kernels on the host), which has no grid
    dependency control."""
    if device.type != "cuda" or rows > MAX_ROWS or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


NO_PDL = {"PDL": False, "launch_pdl": False}  # launch_options of a launch that never uses PDL


def launch_options(device: torch.device, rows: int) -> dict[str, bool]:
    """A launch's PDL keyword arguments: the kernel's `PDL` constexpr and Triton's `launch_pdl`, always
    equal, since a kernel launched with PDL must wait first (wait_for_previous) and only then."""
    use = enabled(device, rows)
    return {"PDL": use, "launch_pdl": use}


@triton.jit
def wait_for_previous(PDL: tl.constexpr, SCHEDULE_NEXT: tl.constexpr = True):
    """The first statement of a kernel that may be launched with PDL (PDL: whether it was): wait for
    the previous kernel on the stream, then (SCHEDULE_NEXT) let the next one be scheduled. Without
    SCHEDULE_NEXT the next kernel is scheduled when this one ends, as without PDL (what measured faster
    after the W8A16 GEMM, whose programs stream weights on every SM: docs/benchmarks.md)."""
    if PDL:
        gdc_wait()
        if SCHEDULE_NEXT:
            gdc_launch_dependents()
