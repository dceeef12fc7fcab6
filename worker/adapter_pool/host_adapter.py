"""Disk → host: an adapter read once, validated, and packed into one flat (pinned) buffer, so the
copy to the device is one large transfer at full host-to-device bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from shared.adapter_format import read_adapter_files, resolve_adapter_dir
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import PROJECTIONS, ModelInfo
from shared.schema import AdapterRef
from worker.engine.peft_adapter import peft_key


@dataclass(frozen=True, slots=True)
class AdapterPart:
    """Where one adapted projection's matrices sit in the flat buffer (offsets in elements)."""

    layer: int
    projection: str  # as PEFT names it: q_proj … down_proj
    a_offset: int  # A [rank, in_features], row-major
    b_offset: int  # B [out_features, rank], row-major
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class HostAdapter:
    """One adapter's weights in host memory, in the model's dtype."""

    uid: str
    rank: int
    scaling: float  # alpha/r, or alpha/√r with rsLoRA
    buffer: torch.Tensor  # flat [sum over parts of rank * (in + out)], pinned when the device is CUDA
    parts: tuple[AdapterPart, ...]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def a(self, part: AdapterPart, source: torch.Tensor | None = None) -> torch.Tensor:
        """A [rank, in_features] of `part`, a view of `source` (the buffer, or its device copy)."""
        flat = self.buffer if source is None else source
        return flat[part.a_offset : part.a_offset + self.rank * part.in_features].view(self.rank, part.in_features)

    def b(self, part: AdapterPart, source: torch.Tensor | None = None) -> torch.Tensor:
        """B [out_features, rank] of `part`, a view of `source` (the buffer, or its device copy)."""
        flat = self.buffer if source is None else source
        return flat[part.b_offset : part.b_offset + part.out_features * self.rank].view(part.out_features, self.rank)


def read_host_adapter(
    ref: AdapterRef,
    *,
    adapter_root: Path,
    info: ModelInfo,
    dtype: torch.dtype,
    max_rank: int,
    max_bytes: int,
    pin: bool,
) -> HostAdapter:
    """Read `ref`'s files (path confined to the root), check them against the base model and the
    registered sha256, and pack them. Raises LorafleetError(ADAPTER_LOAD_FAILED) naming the problem.
    Thread-safe: the pool runs it on its loader threads (file reads and hashing release the GIL)."""
    try:
        adapter_dir = resolve_adapter_dir(adapter_root, ref.path)
        manifest, data = read_adapter_files(adapter_dir, info, max_rank=max_rank, max_bytes=max_bytes)
    except LorafleetError as exc:
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, exc.message) from exc
    if manifest.sha256 != ref.sha256:
        # the registry names exact weights: never serve other bytes under this identity
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, "adapter files changed since registration")
    tensors = load_safetensors(data)
    rank = manifest.rank
    parts = []
    offset = 0
    for layer in range(info.num_layers):
        for projection in manifest.target_modules:
            if peft_key(layer, projection, "A") not in tensors:
                continue  # PEFT's layers_to_transform may skip layers
            in_features, out_features = info.projection_shape(projection)
            parts.append(AdapterPart(layer, projection, offset, offset + rank * in_features, in_features, out_features))
            offset += rank * (in_features + out_features)
    buffer = torch.empty(offset, dtype=dtype, pin_memory=pin)
    adapter = HostAdapter(ref.uid, rank, manifest.scaling, buffer, tuple(parts))
    for part in parts:
        adapter.a(part).copy_(tensors[peft_key(part.layer, part.projection, "A")])
        adapter.b(part).copy_(tensors[peft_key(part.layer, part.projection, "B")])
    return adapter


def max_adapter_bytes(info: ModelInfo, *, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of the largest adapter the pool accepts: max rank on every projection of every layer."""
    per_layer = sum(sum(info.projection_shape(p)) for p in PROJECTIONS)
    return info.num_layers * max_rank * per_layer * torch.empty(0, dtype=dtype).element_size()
