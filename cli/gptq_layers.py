"""GPTQ over a whole model, for `lorafleet quantize`: calibration windows run through the model one
decoder layer at a time, and each layer's projections rounded (kernels/quant/gptq.py, onto a
cli/gptq_targets.py target) against the inputs they receive there. The inputs of layer l are the
outputs of layers 0..l-1 already rounded, as GPTQ does it: later layers are calibrated to absorb the
errors of earlier ones. A layer runs twice per window: unrounded, with its projections' inputs
summed into their Hessians; rounded, for the next layer's inputs. Only the hidden states of the
windows between two layers are kept.

The model is the worker's own (worker/model), built and loaded as a worker loads it, so the
projections rounded are the ones served, packed as served (q/k/v in one, gate/up in one: slices of
one weight share their input, so one Hessian serves them and GPTQ treats their rows apart).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from cli.gptq_targets import GptqTarget
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.lora_linear import LoRALinear
from worker.model.model import CausalLM

BLOCK_SIZE = 16


@torch.inference_mode()
def quantize_layers(
    model: CausalLM,
    windows: Sequence[Sequence[int]],
    target: GptqTarget,
    on_layer: Callable[[int, float], None],
) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint projection name (`model.layers.0.self_attn.q_proj`, ...) → its checkpoint tensors by
    suffix, rounded by GPTQ onto `target`, for every projection of `model` (unquantized, dense) that
    `target` rounds,
    calibrated on `windows` (token ids; each its own sequence from an empty cache). The model's
    projections are left holding their rounded weights. `on_layer(index, seconds)` after each layer."""
    stack = model.model
    device = model.slot_ranks.device
    longest = max(map(len, windows))
    cache = KVCache.allocate(KVLayout.of(model.info, BLOCK_SIZE, model.dtype), -(-longest // BLOCK_SIZE), device)
    batches = [ForwardBatch.scratch_prefill(ids, start=0, block_size=BLOCK_SIZE, device=device) for ids in windows]
    ropes = [stack.rotary_emb.cos_sin(batch.positions, model.dtype) for batch in batches]
    # each window's (hidden states, residual stream) entering the next layer: [T, hidden_size] each
    states: list[tuple[torch.Tensor, torch.Tensor | None]] = [(stack.embed_tokens(b.input_ids), None) for b in batches]
    names = {module: name for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for index, (layer, key_cache, value_cache) in enumerate(zip(stack.layers, cache.key, cache.value, strict=True)):
        started = time.monotonic()
        linears = [
            linear
            for linear in layer.lora_linears()
            if target.rounds(f"{names[linear].rpartition('.')[0]}.{linear.projections[0]}")
        ]
        hessians = {linear: torch.zeros(linear.in_features, linear.in_features, device=device) for linear in linears}
        with inputs_observed(linears, partial(_accumulate, hessians)):
            for (hidden, residual), rope, batch in zip(states, ropes, batches, strict=True):
                # copies: on CUDA the layer updates the residual stream in place
                stream = None if residual is None else residual.clone()
                layer(hidden.clone(), stream, rope, batch, key_cache, value_cache)
        for linear in linears:
            rounded, quantized = target.quantize(linear.weight, hessians[linear])
            linear.weight.copy_(rounded.to(linear.weight.dtype))
            parent, offset = names[linear].rpartition(".")[0], 0
            for projection, width in zip(linear.projections, linear.out_features, strict=True):
                tensors[f"{parent}.{projection}"] = target.tensors(quantized, slice(offset, offset + width))
                offset += width
        states = [
            layer(hidden, residual, rope, batch, key_cache, value_cache)
            for (hidden, residual), rope, batch in zip(states, ropes, batches, strict=True)
        ]
        on_layer(index, time.monotonic() - started)
    return tensors


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
