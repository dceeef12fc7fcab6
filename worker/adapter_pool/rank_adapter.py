"""An adapter as one model process holds it in host memory: read for the whole model, then, on a
tensor-parallel rank, cut down to the rank's part of every projection (worker/model/parallel/
sharding.py: column-parallel parts keep A and split B, row-parallel parts split A and keep B).

The one way an adapter is read for a model: the adapter pool's loader threads on rank 0, and the
follower ranks for the loads rank 0 tells them of, go through `read_for_model`."""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path

from shared.config import EngineConfig
from shared.schema import AdapterRef
from worker.adapter_pool.host_adapter import AdapterPart, BufferSource, HostAdapter, fresh_buffers, read_host_adapter
from worker.model.model import CausalLM
from worker.model.parallel.sharding import ModelShard


def read_for_model(
    ref: AdapterRef,
    model: CausalLM,
    config: EngineConfig,
    adapter_root: Path,
    *,
    take: BufferSource,
    hasher: Executor | None = None,
) -> HostAdapter:
    """`ref` read, validated and hashed against the whole model (read_host_adapter: its pieces
    hashed on `hasher`'s threads), as `model`'s slots take it, in one buffer from `take`: whole, or
    the part of a tensor-parallel rank (the whole read into plain memory first)."""
    adapter = read_host_adapter(
        ref,
        adapter_root=adapter_root,
        info=model.info,
        dtype=model.dtype,
        max_rank=config.max_lora_rank,
        max_bytes=config.max_adapter_bytes,
        take=take if model.shard is None else fresh_buffers(pin=False),
        hasher=hasher,
    )
    return adapter if model.shard is None else shard_adapter(adapter, model.shard, take=take)


def shard_adapter(adapter: HostAdapter, shard: ModelShard, *, take: BufferSource) -> HostAdapter:
    """The rank's part of `adapter`, packed into a buffer of its own from `take`."""
    rank = adapter.rank
    parts: list[AdapterPart] = []
    offset = 0
    for part in adapter.parts:
        split = shard.split(part.projection)
        in_features = split.length if split.row_parallel else part.in_features
        out_features = part.out_features if split.row_parallel else split.length
        experts = max(part.experts, 1)
        b_offset = offset + rank * experts * in_features
        parts.append(
            AdapterPart(part.layer, part.projection, offset, b_offset, in_features, out_features, part.experts)
        )
        offset = b_offset + rank * experts * out_features
    dtype = adapter.buffer.dtype
    buffer = take(offset * dtype.itemsize).view(dtype)
    sharded = HostAdapter(adapter.uid, rank, adapter.scaling, buffer, tuple(parts))
    for whole, part in zip(adapter.parts, parts, strict=True):
        split = shard.split(whole.projection)
        a, b = adapter.a(whole), adapter.b(whole)  # A [r, (E,) in], B [(E,) out, r]
        sharded.a(part).copy_(split.take(a) if split.row_parallel else a)
        sharded.b(part).copy_(b if split.row_parallel else split.take(b))
    return sharded
