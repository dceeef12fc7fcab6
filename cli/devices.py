"""Which GPUs this machine lets a worker use, found without importing torch (the supervisor never needs it)."""

from __future__ import annotations

import os


def visible_gpus() -> list[str]:
    """CUDA device ids, one per worker to start: CUDA_VISIBLE_DEVICES's entries when it is set, else every
    GPU that NVML sees. Empty on a machine without an NVIDIA driver."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for entry in env.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):  # CUDA ignores everything from an invalid entry on
                break
            ids.append(entry)
        return ids
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
