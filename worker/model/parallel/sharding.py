"""Which part of each weight a tensor-parallel rank holds (Megatron's split, as vLLM and SGLang do it).

Column-parallel projections (q, k, v, gate, up: the first of a pair) split their weight [out, in]
by output rows; each rank computes its own columns of the output and needs no collective. Their
LoRA keeps A [r, in] whole (every rank computes the same x @ A.T) and splits B [out, r] by rows.
Row-parallel projections (o, down) split the weight by input columns, so each rank's output is a
partial sum; LoRA A [r, in] splits by columns and B [out, r] stays whole, so the LoRA delta is a
partial sum too and rides the one all-reduce the base projection needs anyway.

Attention heads split with their q/k/v columns and o's input columns, so a rank's attention is its
own heads over its own KV cache. With fewer KV heads than ranks each rank holds the one KV head its
query heads read (replicated across the ranks that share it). Experts split inside (each expert's
gate/up by rows, down by columns), the router is replicated.

A `Split` addresses the split dimension from the end (-2: output rows, -1: input columns), which
is the same axis in a weight [out, in], a LoRA A [r, in] / B [out, r], and the expert-stacked forms
(A [r, E, in], B [E, out, r]).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shared.int4_quantization import INT4_FORMATS
from shared.model_info import EXPERT_PROJECTIONS, ModelInfo
from worker.model.parallel.group import TensorParallel

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Split:
    """A rank's part of a tensor: `length` entries from `start` along `dim` (-2 or -1)."""

    dim: int
    start: int
    length: int

    @property
    def row_parallel(self) -> bool:
        return self.dim == -1

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's view of a whole tensor (a checkpoint's, or an adapter's matrix on this axis)."""
        return tensor.narrow(self.dim, self.start, self.length)

    def take_vector(self, vector: torch.Tensor) -> torch.Tensor:
        """The rank's part of a per-output vector [out] (bias, fp8 scale): split where the outputs
        are (column-parallel), whole where they are not."""
        return vector if self.row_parallel else vector.narrow(0, self.start, self.length)


def shard_info(info: ModelInfo, size: int) -> ModelInfo:
    """The network one of `size` ranks builds for `info`: its share of the query heads, of the KV
    heads (one when there are fewer than ranks), of the MLP's width and of every expert's width.
    Raises ValueError for a model that does not split evenly over `size` ranks, or whose weights are
    in 4 bits (their packed groups are not sharded)."""
    if size > 1 and info.quantization in INT4_FORMATS:
        raise ValueError(f"{info.name}: {info.quantization} 4-bit weights cannot be served with tensor parallelism")
    kv = info.num_kv_heads
    uneven = [
        name
        for name, count in (
            ("num_attention_heads", info.num_heads),
            ("intermediate_size", info.intermediate_size),
            ("moe_intermediate_size", info.moe_intermediate_size),
        )
        if count % size
    ]
    if kv % size and size % kv:
        uneven.append("num_key_value_heads")
    if uneven:
        raise ValueError(f"{info.name}: {', '.join(uneven)} do not split evenly over {size} tensor-parallel ranks")
    return replace(
        info,
        num_heads=info.num_heads // size,
        num_kv_heads=max(1, kv // size),
        intermediate_size=info.intermediate_size // size,
        moe_intermediate_size=info.moe_intermediate_size // size,
    )


@dataclass(frozen=True, slots=True)
class LinearShard:
    """How a rank holds a packed projection: the split of each of its slices (all column- or all
    row-parallel), and the group whose all-reduce completes a row-parallel one."""

    tp: TensorParallel
    splits: tuple[Split, ...]

    @property
    def row_parallel(self) -> bool:
        return self.splits[0].row_parallel


@dataclass(frozen=True, slots=True)
class ModelShard:
    """One rank's part of a model: the network it builds (`local`, a ModelInfo of its shapes) and
    where its part of each projection lies in the whole (`full`) model's weights and adapters."""

    tp: TensorParallel
    full: ModelInfo
    local: ModelInfo

    @classmethod
    def of(cls, info: ModelInfo, tp: TensorParallel) -> ModelShard:
        return cls(tp, info, shard_info(info, tp.size))

    def split(self, projection: str) -> Split:
        """The rank's part of `projection`: a PEFT target name (q_proj … down_proj), or an expert's
        projection as its family names it, prefixed `experts.` (as adapter parts name them)."""
        rank, full, local = self.tp.rank, self.full, self.local
        head_dim = full.head_dim
        if projection.startswith("experts."):
            gate, up, down = EXPERT_PROJECTIONS[full.architecture]
            name = projection.removeprefix("experts.")
            width = local.moe_intermediate_size
            if name not in (gate, up, down):
                raise ValueError(f"no expert projection {name!r} in {full.architecture}")
            return Split(-1 if name == down else -2, rank * width, width)
        if projection == "q_proj":
            return Split(-2, rank * local.num_heads * head_dim, local.num_heads * head_dim)
        if projection in ("k_proj", "v_proj"):
            return Split(-2, self.kv_head_start * head_dim, local.num_kv_heads * head_dim)
        if projection == "o_proj":
            return Split(-1, rank * local.num_heads * head_dim, local.num_heads * head_dim)
        if projection in ("gate_proj", "up_proj"):
            return Split(-2, rank * local.intermediate_size, local.intermediate_size)
        if projection == "down_proj":
            return Split(-1, rank * local.intermediate_size, local.intermediate_size)
        raise ValueError(f"no projection {projection!r} to split")

    def linear(self, *projections: str) -> LinearShard:
        """The shard of a packed projection of these slices."""
        splits = tuple(self.split(name) for name in projections)
        if len({split.row_parallel for split in splits}) != 1:
            raise ValueError(f"{projections} mix column- and row-parallel slices")
        return LinearShard(self.tp, splits)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds: the one its first query head reads."""
        full, local = self.full, self.local
        first_query_head = self.tp.rank * local.num_heads
        return first_query_head // (full.num_heads // full.num_kv_heads)
