"""A worker's share of a GPU that other processes use too (CUDA MPS co-location).

MPS gives no memory isolation: each process must stay under a hard cap, or one worker's KV cache
takes the memory the other's forward pass needs. `--gpu-memory-fraction` sets torch's per-process
cap (allocations past it raise out-of-memory in this process only) and the KV cache is sized
within it. The compute share is the MPS client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read by the
CUDA driver from the environment when the process first touches the GPU; it is logged here.
"""

from __future__ import annotations

import os

import structlog

from shared.config import EngineConfig

log = structlog.get_logger(__name__)


def apply_device_share(config: EngineConfig) -> None:
    """Cap this process's GPU memory at `config.gpu_memory_fraction` (before anything is allocated)."""
    if not config.device.startswith("cuda"):
        return
    import torch

    mps_pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    threads = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if config.gpu_memory_fraction is not None:
        device = torch.device(config.device)
        # torch wants an index here: a plain "cuda" means the current device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, index)
    elif mps_pipe is not None:
        log.warning("mps_without_memory_cap", hint="give --gpu-memory-fraction: MPS does not isolate memory")
    log.info(
        "gpu_share",
        memory_fraction=config.gpu_memory_fraction,
        mps_pipe_directory=mps_pipe,
        mps_active_thread_percentage=threads,
    )
