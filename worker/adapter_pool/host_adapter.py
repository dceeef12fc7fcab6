"""Disk → host: an adapter read once, validated, and packed into one flat (pinned) buffer, so the
copy to the device is one large transfer at full host-to-device bandwidth."""

from __future__ import annotations

import hashlib
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from shared.adapter_format import AdapterManifest, manifest_of, read_adapter_files, resolve_adapter_dir
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import EXPERT_PROJECTIONS, PROJECTIONS, ModelInfo
from shared.schema import AdapterRef
from worker.engine.moe_adapter import expert_loras
from worker.engine.peft_adapter import peft_key


@dataclass(frozen=True, slots=True)
class AdapterPart:
    """Where one adapted projection's matrices sit in the flat buffer (offsets in elements)."""

    layer: int
    projection: str  # as PEFT names it: q_proj … down_proj; `experts.{projection}` for an MoE layer's experts
    a_offset: int  # A [rank, in_features], row-major ([rank, experts, in_features] for experts)
    b_offset: int  # B [out_features, rank], row-major ([experts, out_features, rank] for experts)
    in_features: int
    out_features: int
    experts: int = 0  # 0: one projection; else every expert's LoRA of this projection, stacked

    @property
    def numel(self) -> int:
        """Elements of A and B per unit of rank."""
        return max(self.experts, 1) * (self.in_features + self.out_features)


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
        shape = (self.rank, part.experts, part.in_features) if part.experts else (self.rank, part.in_features)
        return flat[part.a_offset : part.a_offset + self.rank * part.in_features * max(part.experts, 1)].view(shape)

    def b(self, part: AdapterPart, source: torch.Tensor | None = None) -> torch.Tensor:
        """B [out_features, rank] of `part`, a view of `source` (the buffer, or its device copy)."""
        flat = self.buffer if source is None else source
        shape = (part.experts, part.out_features, self.rank) if part.experts else (part.out_features, self.rank)
        return flat[part.b_offset : part.b_offset + part.out_features * self.rank * max(part.experts, 1)].view(shape)


def read_host_adapter(
    ref: AdapterRef,
    *,
    adapter_root: Path,
    info: ModelInfo,
    dtype: torch.dtype,
    max_rank: int,
    max_bytes: int,
    pin: bool,
    hasher: Executor,
) -> HostAdapter:
    """Read `ref`'s files (path confined to the root), check them against the base model and the
    registered sha256, and pack them. Raises LorafleetError(ADAPTER_LOAD_FAILED) naming the problem.
    Thread-safe: the pool runs it on its loader threads (file reads and hashing release the GIL);
    the bytes are hashed on `hasher` while they are validated and packed here."""
    try:
        adapter_dir = resolve_adapter_dir(adapter_root, ref.path)
        config, data = read_adapter_files(adapter_dir, max_rank=max_rank, max_bytes=max_bytes)
        digest = hasher.submit(_sha256, data)
        # the manifest takes the registered digest: `digest` must equal it before anything is returned
        manifest = manifest_of(config, data, info, sha256=ref.sha256)
    except LorafleetError as exc:
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, exc.message) from exc
    adapter = _pack(ref, manifest, data, info, dtype, pin)
    if digest.result() != ref.sha256:
        # the registry names exact weights: never serve other bytes under this identity
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, "adapter files changed since registration")
    return adapter


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pack(
    ref: AdapterRef, manifest: AdapterManifest, data: bytes, info: ModelInfo, dtype: torch.dtype, pin: bool
) -> HostAdapter:
    """Every LoRA matrix of the validated weights `data`, packed in `dtype` into one flat buffer."""
    tensors = load_safetensors(data)
    # one rank for every part: the largest any part has (a fused gate_up LoRA's is 2r); smaller
    # parts fill their first ranks and the zeroed rest adds nothing
    rank = manifest.serving_rank
    parts = []
    offset = 0
    for layer in range(info.num_layers):
        for projection in manifest.target_modules:
            if peft_key(layer, projection, "A") not in tensors:
                continue  # PEFT's layers_to_transform may skip layers
            in_features, out_features = info.projection_shape(projection)
            parts.append(AdapterPart(layer, projection, offset, offset + rank * in_features, in_features, out_features))
            offset += rank * (in_features + out_features)
    expert_parts = []
    experts = expert_loras(tensors, info, manifest.fused_experts, manifest.scaling)
    for layer, projection in experts:
        in_features, out_features = info.expert_projection_shape(projection)
        b_offset = offset + rank * info.num_experts * in_features
        name = f"experts.{projection}"
        part = AdapterPart(layer, name, offset, b_offset, in_features, out_features, info.num_experts)
        expert_parts.append((part, projection))
        offset += rank * part.numel
    padded = rank > manifest.rank
    buffer = (torch.zeros if padded else torch.empty)(offset, dtype=dtype, pin_memory=pin)
    adapter = HostAdapter(ref.uid, rank, manifest.scaling, buffer, tuple(parts) + tuple(p for p, _ in expert_parts))
    for part in parts:
        adapter.a(part)[: manifest.rank].copy_(tensors[peft_key(part.layer, part.projection, "A")])
        adapter.b(part)[:, : manifest.rank].copy_(tensors[peft_key(part.layer, part.projection, "B")])
    for part, projection in expert_parts:
        a, b = experts[(part.layer, projection)]  # [E, r, in], [E, out, r]
        adapter.a(part)[: a.shape[1]].copy_(a.transpose(0, 1))
        adapter.b(part)[..., : b.shape[2]].copy_(b)
    return adapter


def max_adapter_bytes(info: ModelInfo, *, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of the largest adapter the pool accepts: max rank on every projection of every layer."""
    per_layer = sum(sum(info.projection_shape(p)) for p in PROJECTIONS)
    per_moe_layer = 0
    if info.is_moe:  # experts instead of the dense MLP
        dense = sum(sum(info.projection_shape(p)) for p in ("gate_proj", "up_proj", "down_proj"))
        projections = EXPERT_PROJECTIONS[info.architecture]
        experts = info.num_experts * sum(sum(info.expert_projection_shape(p)) for p in projections)
        per_moe_layer = experts - dense
    total = info.num_layers * per_layer + len(info.moe_layers) * per_moe_layer
    return max_rank * total * torch.empty(0, dtype=dtype).element_size()
