"""The decode roofline the engine rows stand beside: the bytes a decode step must read, over the
measured device-to-device copy bandwidth."""

from __future__ import annotations

import torch

from shared.int4_quantization import INT4_FORMATS
from shared.model_info import PROJECTIONS, ModelInfo


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


def projection_bytes(info: ModelInfo, layer: int, projection: str) -> int:
    """Bytes of decoder layer `layer`'s `projection` in the format it is served in: one byte a weight and
    a float32 scale per output row in fp8; half a byte a weight and, per group of weight_group_size
    inputs of each output, a float16 scale and zero point (int4, AWQ, GPTQ) or a float32 absmax (NF4,
    FP4) in 4 bits; two bytes a weight in bf16 (a checkpoint's ignore list keeps some so)."""
    inputs, outputs = info.projection_shape(projection)
    weights = inputs * outputs
    quantization = info.projection_quantization(layer, projection)
    if quantization == "fp8":
        return weights + 4 * outputs
    if quantization in INT4_FORMATS:
        return weights // 2 + 4 * weights // info.weight_group_size
    return 2 * weights


def weight_bytes(info: ModelInfo) -> int:
    """Bytes a decode step reads: every layer's projections (projection_bytes) and norms, and the lm_head
    (embedding rows are few)."""
    h = info.hidden_size
    layers = range(info.num_layers)
    projections = sum(projection_bytes(info, layer, projection) for layer in layers for projection in PROJECTIONS)
    return projections + info.num_layers * 2 * 2 * h + 2 * (info.vocab_size * h + h)


def roofline(info: ModelInfo, batch: int, context: float, bandwidth: float) -> float:
    """Output tok/s if a decode step only moved its weights and K/V at `bandwidth` bytes/s."""
    kv_element = 1 if info.kv_cache_dtype == "fp8" else 2
    kv = 2 * kv_element * info.num_layers * info.num_kv_heads * info.head_dim * context * batch
    return batch / ((weight_bytes(info) + kv) / bandwidth)
