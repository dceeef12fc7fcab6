"""GPTQ over a whole model, for `lorafleet quantize`: calibration windows run through the model one
decoder layer at a time, and each layer's projections quantized (kernels/quant/gptq.py) against the
inputs they receive there. The inputs of layer l are the outputs of layers 0..l-1 already quantized,
as GPTQ does it: later layers are calibrated to absorb the errors of earlier ones. A layer runs twice
per window: unquantized, with its projections' inputs summed into their Hessians; quantized, for the
next layer's inputs. Only the hidden states of the windows between two layers are kept.

The model is the worker's own (worker/model), built and loaded as a worker loads it, so the
projections quantized are the ones served, packed as served (q/k/v in one, gate/up in one: slices of
one weight share their input, so one Hessian serves them and GPTQ treats their rows apart).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from kernels.quant.gptq import gptq_int4
from kernels.quant.int4_reference import Int4Weight, dequantize_int4
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.lora_linear import LoRALinear
from worker.model.model import CausalLM

BLOCK_SIZE = 16


@torch.inference_mode()
def quantize_layers(
    model: CausalLM,
    windows: Sequence[Sequence[int]],
    group_size: int,
    on_layer: Callable[[int, float], None],
) -> dict[str, Int4Weight]:
    """Checkpoint projection name (`model.layers.0.self_attn.q_proj`, ...) → its GPTQ 4-bit weight in
    groups of `group_size` inputs, for every projection of `model` (unquantized, dense), calibrated
    on `windows` (token ids; each its own sequence from an empty cache). The model's projections are
    left holding their quantized weights, dequantized. `on_layer(index, seconds)` after each layer."""
    stack = model.model
    device = model.slot_ranks.device
    longest = max(map(len, windows))
    cache = KVCache.allocate(KVLayout.of(model.info, BLOCK_SIZE, model.dtype), -(-longest // BLOCK_SIZE), device)
    batches = [ForwardBatch.scratch_prefill(ids, start=0, block_size=BLOCK_SIZE, device=device) for ids in windows]
    ropes = [stack.rotary_emb.cos_sin(batch.positions, model.dtype) for batch in batches]
    # each window's (hidden states, residual stream) entering the next layer: [T, hidden_size] each
    states: list[tuple[torch.Tensor, torch.Tensor | None]] = [(stack.embed_tokens(b.input_ids), None) for b in batches]
    names = {module: name for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    quantized: dict[str, Int4Weight] = {}
    for index, (layer, key_cache, value_cache) in enumerate(zip(stack.layers, cache.key, cache.value, strict=True)):
        started = time.monotonic()
        linears = layer.lora_linears()
        hessians = {linear: torch.zeros(linear.in_features, linear.in_features, device=device) for linear in linears}
        with inputs_observed(linears, partial(_accumulate, hessians)):
            for (hidden, residual), rope, batch in zip(states, ropes, batches, strict=True):
                # copies: on CUDA the layer updates the residual stream in place
                stream = None if residual is None else residual.clone()
                layer(hidden.clone(), stream, rope, batch, key_cache, value_cache)
        for linear in linears:
            _, weight = gptq_int4(linear.weight, hessians[linear], group_size)
            linear.weight.copy_(dequantize_int4(weight).to(linear.weight.dtype))
            quantized.update(_slices(names[linear], linear, weight))
        states = [
            layer(hidden, residual, rope, batch, key_cache, value_cache)
            for (hidden, residual), rope, batch in zip(states, ropes, batches, strict=True)
        ]
        on_layer(index, time.monotonic() - started)
    return quantized


@contextlib.contextmanager
def inputs_observed(
    linears: Sequence[LoRALinear], observe: Callable[[LoRALinear, torch.Tensor], None]
) -> Iterator[None]:
    """Within the block, `observe(linear, x)` sees each input x [T, in_features] of `linears` before
    they compute. Both entry points are wrapped on the instances (module hooks see only `forward`;
    packed q/k/v and gate/up are called through `forward_deferred`)."""
    for linear in linears:
        for method in ("forward", "forward_deferred"):
            compute = getattr(linear, method)

            def observed(x: torch.Tensor, *args, _compute=compute, _linear=linear, **kwargs):
                observe(_linear, x.reshape(-1, x.shape[-1]))
                return _compute(x, *args, **kwargs)

            setattr(linear, method, observed)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward, linear.forward_deferred  # the class's methods again


def _accumulate(hessians: dict[LoRALinear, torch.Tensor], linear: LoRALinear, x: torch.Tensor) -> None:
    """Add the inputs x [T, K] into linear's Hessian, X.T @ X [K, K] (float32)."""
    x = x.float()
    hessians[linear].addmm_(x.T, x)


def _slices(name: str, linear: LoRALinear, weight: Int4Weight) -> dict[str, Int4Weight]:
    """The checkpoint projections packed in `linear` (module `name`), each its output columns of `weight`."""
    parent = name.rpartition(".")[0]
    slices, offset = {}, 0
    for projection, width in zip(linear.projections, linear.out_features, strict=True):
        columns = slice(offset, offset + width)
        slices[f"{parent}.{projection}"] = Int4Weight(
            qweight=weight.qweight[:, columns],
            scales=weight.scales[:, columns],
            zeros=weight.zeros[:, columns],
            arrivals=weight.arrivals,
        )
        offset += width
    return slices
