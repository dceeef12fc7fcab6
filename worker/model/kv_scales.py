"""The FP8 KV cache's scales: what each layer's K and V are divided by, per KV head, before they are
rounded to e4m3 (kernels/attention/__init__.py gives the arithmetic).

e4m3 holds 3 mantissa bits for magnitudes from 2**-6 to 448 and fewer below (its subnormals reach
2**-9). Unscaled, a model whose K/V are small (SmolLM2-135M's: docs/benchmarks.md, "Quality on real
weights") stores many of them as subnormals or zeros; divided by a scale that maps each head's largest
value into the top of e4m3's range, every value but the smallest (below about amax * 2**-13) keeps
the full 3 bits.

Two sources, per model:
- A pre-quantized checkpoint's published scales (compressed-tensors / llm-compressor and vLLM-style
  checkpoints: `….self_attn.k_scale` / `v_scale`, or AutoFP8's `….self_attn.k_proj.output_scale` /
  `v_proj.output_scale`), each one value per tensor (broadcast to every KV head) or one per KV head.
  They mean what ours mean: the stored value times the scale is the real one. CausalLM.load_tensors
  diverts them here (`KVScaleLoader`); every layer's K and V, or none.
- Otherwise calibrated once when the engine is built (worker/engine/kv_calibration.py, called by
  the model runner before the graphs are captured): per layer and KV head, the largest |K| (after
  RoPE) and |V| of one forward over a fixed input, times a margin, over FP8_MAX.

The scales are fixed device tensors (SelfAttention.kv_scales), allocated with the model: the decode
and piecewise graphs read whatever they hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch

# k / v scales a checkpoint publishes, by the layer they belong to and the row of kv_scales they fill
_PUBLISHED = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


class KVScaleLoader:
    """Takes a checkpoint's published k / v scales out of its tensor stream into the model's layers,
    and says whether it held any (`published`). A checkpoint holds every layer's K and V scale, or
    none: anything between is an error naming the checkpoint and what is missing."""

    def __init__(self, targets: Sequence[torch.Tensor], *, num_kv_heads: int, kv_head_start: int = 0) -> None:
        """targets: every layer's kv_scales, float32 [2, local KV heads]; num_kv_heads: the whole
        model's; kv_head_start: a tensor-parallel rank's first KV head (0 without)."""
        self._targets = targets
        self._num_kv_heads = num_kv_heads
        self._kv_head_start = kv_head_start
        self._filled: set[tuple[int, int]] = set()  # (layer, 0 for K / 1 for V)

    @property
    def published(self) -> bool:
        return bool(self._filled)

    def divert(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`tensors` without the published k / v scales, which are copied into the layers' kv_scales."""
        for name, tensor in tensors:
            match = _PUBLISHED.match(name)
            if match is None:
                yield name, tensor
                continue
            layer = int(match[1])
            row = 0 if (match[2] or match[3]) == "k" else 1
            if (layer, row) in self._filled or layer >= len(self._targets):
                raise ValueError(f"checkpoint tensor {name!r} is given twice or names no layer of this model")
            self._load(layer, row, tensor, name)
            self._filled.add((layer, row))

    def check(self, source: str) -> None:
        """Raise (naming `source`, the checkpoint) if it published some layers' scales but not all."""
        if not self._filled:
            return
        layers = len(self._targets)
        missing = [f"{'kv'[row]}_scale of layer {layer}" for layer in range(layers) for row in (0, 1)
                   if (layer, row) not in self._filled]  # fmt: skip
        if missing:
            raise ValueError(f"{source}: the checkpoint publishes KV cache scales but lacks {len(missing)}: "
                             f"{', '.join(missing[:5])}")  # fmt: skip

    def _load(self, layer: int, row: int, tensor: torch.Tensor, name: str) -> None:
        """One published scale (one value, or one per KV head of the whole model) into row `row` of
        `layer`'s kv_scales [2, local KV heads]: a tensor-parallel rank takes its own heads' values."""
        target = self._targets[layer][row]
        values = tensor.reshape(-1).to(torch.float32)
        heads = self._num_kv_heads
        if values.numel() == heads and heads > 1:
            values = values[self._kv_head_start : self._kv_head_start + target.numel()]
        elif values.numel() != 1:
            raise ValueError(f"{name}: a KV cache scale of shape {tuple(tensor.shape)} is neither per tensor "
                             f"nor per KV head ({heads})")  # fmt: skip
        if not bool((values > 0).all()) or not bool(values.isfinite().all()):
            raise ValueError(f"{name}: KV cache scales must be positive and finite, got {values.tolist()}")
        target.copy_(values.expand(target.shape))
