"""Calibration of the FP8 KV cache's scales (worker/model/kv_scales.py) for a checkpoint that
publishes none: one deterministic forward, once, when the engine is built.

The forward runs CALIBRATION_TOKENS fixed tokens into a scratch cache in the activations' dtype, so
that cache holds every layer's K after RoPE and V exactly as the fp8 cache would receive them before
rounding; per layer and KV head, scale = amax * MARGIN / FP8_MAX, at least MIN_KV_SCALE. The model
runner calls it (worker/engine/model_runner.py): the one place every engine, a worker's or a test's,
is built, after the weights are loaded and before any graph is captured.
"""

from __future__ import annotations

import torch

from kernels.quant.reference import FP8_MAX
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.model import CausalLM

# The calibration input: the first CALIBRATION_TOKENS of the sequence bos, then token ids spread over
# the whole vocabulary by a fixed stride (calibration_tokens). Why this is representative enough:
# - each token's hidden state is RMS-normalised before the K/V projection, so K/V magnitudes follow
#   the projections' weights and the directions of the hidden states, not their length; tokens from
#   every part of the vocabulary (frequent ids low, rare ones high) give the projections many
#   directions, over every layer's attention mixing them;
# - RoPE only rotates pairs of K's dimensions: neither element of a pair ever exceeds the pair's norm,
#   and at any angle the larger of the two is at least norm / sqrt(2), so positions the calibration
#   never reached raise a head's amax by at most sqrt(2), inside MARGIN;
# - position 0 is the sequence start, where real models put large "attention sink" K/V: it is there.
# A value past the calibrated range saturates at ±448 (a bounded error, never NaN).
CALIBRATION_TOKENS = 256
# Headroom over the calibration's largest value: 4 = two binades. It costs the small values almost
# nothing: e4m3's normals (3 mantissa bits, a relative error of at most 2**-4) then reach down to
# amax * 2**-12.8 instead of amax * 2**-14.8, and below that a value's absolute error is at most half
# a subnormal step, amax * 2**-16.8, negligible beside the normal values' error. It keeps K/V up to
# 4x the calibration's largest unsaturated. vLLM's dynamic scales (amax / 200 for K, / 100 for V)
# leave 2.2x and 4.5x.
MARGIN = 4.0
# The floor only keeps a head silent on the calibration input (amax 0) dividing finitely (0 / it = 0):
# the smallest normal float32, so every head with any normal value gets a scale of its own. (The
# weights' MIN_SCALE, 2**-17.8, would floor heads whose amax is below 5e-4, K/V a model can have.)
MIN_KV_SCALE = torch.finfo(torch.float32).tiny
# a prime stride (coprime with any vocabulary size it does not divide): consecutive ids far apart, none repeated
_STRIDE = 20011


def calibration_tokens(vocab_size: int, count: int, bos_token_id: int | None) -> list[int]:
    """`count` token ids: bos (when the model has one), then ids spread over the whole vocabulary."""
    first = [bos_token_id] if bos_token_id is not None else []
    return (first + [(1 + i * _STRIDE) % vocab_size for i in range(count)])[:count]


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 scales for amax (any shape): amax * MARGIN / FP8_MAX, at least MIN_KV_SCALE."""
    amax = amax.float()
    # a tensor divisor: a true division on every device (kernels/quant/reference.rowwise_scales)
    return (amax * MARGIN / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_KV_SCALE)


@torch.inference_mode()
def calibrate_kv_scales(model: CausalLM, *, block_size: int, max_tokens: int) -> None:
    """Fill every layer's kv_scales from a forward of calibration_tokens into a scratch cache in the
    activations' dtype, prefilled in chunks of at most `max_tokens` (the step the memory plan budgets
    activations for; chunked prefill caches the same K/V as one forward).

    Under tensor parallelism every rank runs it at once (the forward's collectives) and calibrates
    its own KV heads. The scratch cache is small (32 MiB for Llama-3-8B's 256 tokens in bf16), freed
    after."""
    info = model.local_info
    device = model.slot_ranks.device
    count = min(CALIBRATION_TOKENS, model.info.max_context)
    tokens = calibration_tokens(model.info.vocab_size, count, model.info.bos_token_id)
    layout = KVLayout(info.num_layers, block_size, info.num_kv_heads, info.head_dim, model.dtype)
    cache = KVCache.allocate(layout, -(-count // block_size), device)
    for start in range(0, count, max_tokens):
        chunk = tokens[start : start + max_tokens]
        batch = ForwardBatch.scratch_prefill(chunk, start=start, block_size=block_size, device=device)
        model.forward(batch, cache)
    # slots past `count` stay zero (the cache is allocated zeroed): they never raise an amax
    for layer, key, value in zip(model.model.layers, cache.key, cache.value, strict=True):
        amax = torch.stack([key.abs().amax(dim=(0, 1, 3)), value.abs().amax(dim=(0, 1, 3))])  # [2, H_kv]
        layer.self_attn.kv_scales.copy_(scales_from_amax(amax))
