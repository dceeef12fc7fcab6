"""The second CUDA stream that LoRA work runs on beside the base GEMMs.

A LoRA delta needs only the projection's input, so its kernels can run while the base GEMM runs and
leave the critical path:

    with beside(x.device):          # after everything launched so far on the current stream
        z = shrink(x, ...)          # launched on the side stream
    y = gemm(x, ...)                # meanwhile, on the current stream
    join(x.device, z)               # the current stream waits for the side stream; z is read there
    expand(y, z, ...)

Fork and join are stream waits, so the pattern is captured into CUDA graphs as a branch and replayed
as one. On a CPU device (the Triton interpreter) both are no-ops and the body runs in order.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch


@functools.cache
def _stream(device: torch.device, thread: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device and thread: a model's decode graphs may be captured on a loader thread
    while another model serves on the engine thread, and a stream shared by the two would pull the
    server's launches into the capture."""
    return _stream(device, threading.get_ident())


@contextlib.contextmanager
def beside(device: torch.device) -> Iterator[None]:
    """Launch the body's kernels on the side stream, once the current stream's work so far is done."""
    if device.type != "cuda":
        yield
        return
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def join(device: torch.device, *made_on_side: torch.Tensor) -> None:
    """Make the current stream wait for the side stream's work so far. made_on_side: tensors the side
    stream allocated that the current stream reads too (so their memory is not reused before)."""
    if device.type != "cuda":
        return
    main = torch.cuda.current_stream(device)
    main.wait_stream(side_stream(device))
    for tensor in made_on_side:
        tensor.record_stream(main)
