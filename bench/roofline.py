"""The decode roofline the engine rows stand beside: the bytes a decode step must read, over the
measured device-to-device copy bandwidth."""

from __future__ import annotations

import torch

from bench.int4 import int4_projection_bytes
from shared.model_info import ModelInfo


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20 copies of 1 GiB)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[10]


def weight_bytes(info: ModelInfo) -> int:
    """Bytes a decode step reads: every layer's weights and the lm_head (embedding rows are few); the
    projections in one byte each (and a float32 scale per output row) when served in fp8, in half a
    byte (and a float16 scale and zero point, or a float32 absmax, per group) in 4 bits."""
    h, i, kv = info.hidden_size, info.intermediate_size, info.num_kv_heads * info.head_dim
    rows = (h + 2 * kv) + h + 2 * i + h
    projections = h * (h + 2 * kv) + h * h + 3 * h * i
    projection_bytes = projections + 4 * rows if info.quantization == "fp8" else 2 * projections
    if info.quantization in ("int4", "nf4"):
        projection_bytes = int4_projection_bytes(info)
    return info.num_layers * (projection_bytes + 2 * 2 * h) + 2 * (info.vocab_size * h + h)


def roofline(info: ModelInfo, batch: int, context: float, bandwidth: float) -> float:
    """Output tok/s if a decode step only moved its weights and K/V at `bandwidth` bytes/s."""
    kv_element = 1 if info.kv_cache_dtype == "fp8" else 2
    kv = 2 * kv_element * info.num_layers * info.num_kv_heads * info.head_dim * context * batch
    return batch / ((weight_bytes(info) + kv) / bandwidth)
