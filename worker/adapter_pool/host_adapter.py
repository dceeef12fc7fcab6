"""Disk → host: an adapter read once, validated, and held in one flat (pinned) buffer, so the copy to
the device is one large transfer at full host-to-device bandwidth. The buffer comes from the caller's
`BufferSource`: the pool's, a block carved from its page-locked host arena (host_arena.py).

The file is read once. In the common case its data section goes straight into that buffer and is
used in place (`_parts_in_place`): a PEFT file whose tensors are dense projections' A/B
in the model's dtype already is what the slots take, so the host copies nothing and a loader thread
makes a handful of calls (each one a GIL hand-off with the engine thread, which is what made
per-tensor packing slow under load). Other files (MoE experts, fused expert forms, another dtype)
are read into plain memory and packed tensor by tensor from it into the buffer (`_pack`), never
read again."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from shared.adapter_digest import SCHEME
from shared.adapter_format import AdapterManifest, read_adapter
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import EXPERT_PROJECTIONS, PROJECTIONS, ModelInfo
from shared.safetensors_table import TensorEntry
from shared.schema import AdapterRef
from worker.adapter_pool.moe_adapter import expert_loras
from worker.adapter_pool.peft_adapter import peft_key

# nbytes → a uint8 buffer [nbytes] an adapter's packed weights are held in (pinned where the device
# copies from it)
BufferSource = Callable[[int], torch.Tensor]

_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


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
class BufferLayout:
    """An adapter's dense parts as consecutive segments of its flat buffer, so that a copy of the
    buffer is cut into every A and B by one `split_with_sizes` call: two Python views per part (448
    for Llama-3-8B) cost the engine thread milliseconds per load. Expert parts are few and are
    viewed one by one (their slot views are strided anyway)."""

    sizes: tuple[int, ...]  # elements of each segment, in buffer order; gaps and expert parts are segments too
    a_segments: tuple[int, ...]  # per dense part, in `targets` order: its segment, A [rank, in] flattened
    b_segments: tuple[int, ...]  # per dense part: its segment, B [out, rank] flattened
    targets: tuple[tuple[int, str], ...]  # (layer, projection) of every part: the dense ones, then `experts`'
    experts: tuple[AdapterPart, ...]

    @classmethod
    def of(cls, rank: int, parts: tuple[AdapterPart, ...], numel: int) -> BufferLayout:
        """The layout of `parts` at `rank` in a buffer of `numel` elements. Raises ValueError when
        two parts overlap or one ends past the buffer."""
        dense = [part for part in parts if not part.experts]
        experts = tuple(part for part in parts if part.experts)
        spans = sorted(
            [(part.a_offset, rank * part.in_features, 2 * i) for i, part in enumerate(dense)]
            + [(part.b_offset, part.out_features * rank, 2 * i + 1) for i, part in enumerate(dense)]
        )
        sizes: list[int] = []
        segment_of = [0] * len(spans)  # A of part i at 2i, its B at 2i + 1
        end = 0
        for offset, size, matrix in spans:
            if offset < end:
                raise ValueError(f"LoRA matrices overlap in the buffer at element {offset}")
            if offset > end:
                sizes.append(offset - end)
            segment_of[matrix] = len(sizes)
            sizes.append(size)
            end = offset + size
        if end > numel:
            raise ValueError(f"LoRA matrices end at element {end}, past the buffer's {numel}")
        sizes.append(numel - end)
        targets = tuple((part.layer, part.projection) for part in (*dense, *experts))
        return cls(tuple(sizes), tuple(segment_of[0::2]), tuple(segment_of[1::2]), targets, experts)

    def split(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`flat` (the buffer, or a copy of it) → (every dense part's A [rank * in], every dense
        part's B [out * rank]), flat views in `targets` order."""
        segments = flat.split_with_sizes(self.sizes)
        return [segments[i] for i in self.a_segments], [segments[i] for i in self.b_segments]


@dataclass(frozen=True, slots=True)
class HostAdapter:
    """One adapter's weights in host memory, in the model's dtype."""

    uid: str
    rank: int
    scaling: float  # alpha/r, or alpha/√r with rsLoRA
    buffer: torch.Tensor  # flat [sum over parts of rank * (in + out)], from the reader's BufferSource
    parts: tuple[AdapterPart, ...]
    layout: BufferLayout = field(init=False)  # of `parts`, worked out here, on the loader thread

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", BufferLayout.of(self.rank, self.parts, self.buffer.numel()))

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
    take: BufferSource,
    hasher: Executor | None = None,
) -> HostAdapter:
    """Read `ref`'s files once (shared/adapter_format.read_adapter: confined to the root, validated
    against the base model, hashed), check them against the registered digest, and hold them in
    `dtype`, in one buffer from `take` (asked once; what it raises goes through). Raises
    LorafleetError(ADAPTER_LOAD_FAILED) naming the problem. Thread-safe: the pool runs it on its
    loader threads (file reads and hashing release the GIL), the pieces' hashes on `hasher` (in turn
    without one)."""
    raw: list[torch.Tensor] = []
    in_place: list[tuple[AdapterPart, ...] | None] = []

    def allocate(nbytes: int, manifest: AdapterManifest, tensors: dict[str, TensorEntry]) -> memoryview:
        # the file's data is the adapter's buffer when its tensors are already laid out as the slots take
        # them; otherwise it is packed from plain memory into a buffer of its own
        in_place.append(_parts_in_place(tensors, info, dtype, manifest))
        raw.append(take(nbytes) if in_place[0] is not None else torch.empty(nbytes, dtype=torch.uint8))
        return memoryview(raw[0].numpy())

    try:
        files = read_adapter(
            adapter_root, ref.path, info, max_rank=max_rank, max_bytes=max_bytes, allocate=allocate, hasher=hasher
        )
    except LorafleetError as exc:
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, exc.message) from exc
    scheme = ref.digest.partition(":")[0]
    if scheme != SCHEME:
        raise LorafleetError(
            ErrorCode.ADAPTER_LOAD_FAILED,
            f"adapter registered with identity scheme {scheme[:40]!r}, this worker checks {SCHEME!r}: "
            "register it again",
        )
    if files.manifest.digest != ref.digest:
        # the registry names exact weights: never serve other bytes under this identity
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, "adapter files changed since registration")
    manifest = files.manifest
    parts = in_place[0]
    if parts is None:  # the read bytes, packed tensor by tensor
        return _pack(ref, manifest, files.weights_file(), info, dtype, take)
    try:
        return HostAdapter(ref.uid, manifest.rank, manifest.scaling, raw[0].view(dtype), parts)
    except ValueError as exc:  # overlapping tensors: the safetensors table allows none
        raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, str(exc)) from exc


def _parts_in_place(
    tensors: dict[str, TensorEntry], info: ModelInfo, dtype: torch.dtype, manifest: AdapterManifest
) -> tuple[AdapterPart, ...] | None:
    """Where each projection's A [r, in] and B [out, r] already sit in the file's data section, in
    elements of `dtype`; None unless every tensor is one of those, in `dtype`, at the adapter's rank
    (the table's offsets were checked against the shapes and the data's length when it was read)."""
    if manifest.serving_rank != manifest.rank or manifest.fused_experts is not None:
        return None
    itemsize = dtype.itemsize
    parts = []
    for layer in range(info.num_layers):
        for projection in manifest.target_modules:
            keys = (peft_key(layer, projection, "A"), peft_key(layer, projection, "B"))
            if keys[0] not in tensors:
                continue  # PEFT's layers_to_transform may skip layers
            entries = [tensors[key] for key in keys]
            if any(entry.dtype != _SAFETENSORS_DTYPE.get(dtype) or entry.begin % itemsize for entry in entries):
                return None
            in_features, out_features = info.projection_shape(projection)
            a_offset, b_offset = (entry.begin // itemsize for entry in entries)
            parts.append(AdapterPart(layer, projection, a_offset, b_offset, in_features, out_features))
    return tuple(parts) if 2 * len(parts) == len(tensors) else None  # anything else (experts): pack


def _pack(
    ref: AdapterRef, manifest: AdapterManifest, data: bytes, info: ModelInfo, dtype: torch.dtype, take: BufferSource
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
    buffer = take(offset * dtype.itemsize).view(dtype)
    if padded:
        buffer.zero_()
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


def fresh_buffers(*, pin: bool) -> BufferSource:
    """A new buffer per adapter (page-locked when `pin`): a tensor-parallel follower's reads, and
    tests and benches that read adapters outside a pool."""
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
