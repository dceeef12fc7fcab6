"""A random decoder layer of given projection shapes, its adapters paged as the engine pages them,
and one step's LoRA metadata over it: what the tuner and bench.lora_kernels time, on a CUDA GPU.

Token layout, as a served step carries them: up to DECODE_MAX_TOKENS tokens are decode tokens, each of
its own request, adapters spread evenly and shuffled; above, a mixed step: MIXED_DECODES decode tokens
laid out the same way, then prefill chunks of at most PREFILL_CHUNK contiguous tokens, each of one
request whose adapter is one of the chosen ones in turn. (A served step at saturation carries ~90-128
decodes beside its prefill chunks: bench.e2e's worker table.)
Adapters sit in random slots of a POOL_SLOTS-slot pool whose max rank is the case's rank, stored in
pages of `page_rank` rank rows scattered over the page pool in random order (page_rank 0: the
unpaged layout, one page of the case's rank per slot).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.lora.metadata import LoRABatch

POOL_SLOTS = 64
DECODE_MAX_TOKENS = 256
MIXED_DECODES = 128
PREFILL_CHUNK = 256
HEAD_DIM = 128  # the attention head width of most models: q heads = q width / head_dim


class ProjectionShape(NamedTuple):
    """One adapted projection of a layer. `name` is its role, which says how the decoder consumes its
    output (timing.py): "qkv" and "gate_up" defer their delta to the next fused kernel, "o" and
    "down" add theirs into the residual stream."""

    name: str
    k: int  # in features
    widths: tuple[int, ...]  # out features of each packed slice (q|k|v, gate|up)


@dataclass(frozen=True)
class LayerShapes:
    """A model's adapted dense projections of one decoder layer, and how the engine serves them."""

    projections: tuple[ProjectionShape, ...]
    page_rank: int  # rank rows per adapter page as the engine pages them; 0: one page of the whole rank
    qk_norm: bool = False  # q/k heads normalised before RoPE: the qkv delta is added by a pass of its own
    head_dim: int = HEAD_DIM


@dataclass
class Projection:
    name: str
    rank: int  # every adapter's
    weight: torch.Tensor  # [sum N_i, K]
    lora_a: list[torch.Tensor]  # [P, PR, K] per slice
    lora_b: list[torch.Tensor]  # [P, N_i, PR] per slice

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(b.shape[1] for b in self.lora_b)

    def adapter_bytes(self) -> int:
        """Bytes of one adapter's A and B over all slices."""
        return sum(self.rank * (a.shape[2] + b.shape[1]) for a, b in zip(self.lora_a, self.lora_b, strict=True)) * 2


def pages_per_slot(rank: int, page_rank: int) -> int:
    """Pages an adapter of this rank takes (page_rank 0: the unpaged layout, one page)."""
    return math.ceil(rank / page_rank) if page_rank else 1


def make_layer(
    rank: int, projections: tuple[ProjectionShape, ...], *, page_rank: int, slots: int = POOL_SLOTS
) -> list[Projection]:
    """The layer's projections in bf16 with a pool of `slots` adapters of this rank, in pages of
    page_rank rows (0: unpaged)."""
    pages, rows = slots * pages_per_slot(rank, page_rank), page_rank or rank

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)

    return [
        Projection(
            name=name,
            rank=rank,
            weight=rand(sum(widths), k, scale=k**-0.5),
            lora_a=[rand(pages, rows, k, scale=k**-0.5) for _ in widths],
            lora_b=[rand(pages, n, rows, scale=rank**-0.5) for n in widths],
        )
        for name, k, widths in projections
    ]


def slot_layout(num_tokens: int, adapters: int, slots: int = POOL_SLOTS, seed: int = 0) -> list[int]:
    """Slot of each token (see the module docstring for the layout)."""
    rng = random.Random(seed)
    chosen = rng.sample(range(slots), adapters)
    decodes = num_tokens if num_tokens <= DECODE_MAX_TOKENS else MIXED_DECODES
    per_token = [chosen[i % adapters] for i in range(decodes)]
    rng.shuffle(per_token)
    prefill = num_tokens - decodes
    chunks = math.ceil(prefill / PREFILL_CHUNK)
    for c in range(chunks):  # near-equal chunks, in order
        per_token += [chosen[c % adapters]] * (prefill * (c + 1) // chunks - prefill * c // chunks)
    return per_token


def token_slots(num_tokens: int, adapters: int, slots: int = POOL_SLOTS, seed: int = 0) -> torch.Tensor:
    """int32 [T] on the GPU: slot_layout's slots."""
    return torch.tensor(slot_layout(num_tokens, adapters, slots, seed), dtype=torch.int32, device="cuda")


def make_batch(num_tokens: int, adapters: int, rank: int, *, page_rank: int, slots: int = POOL_SLOTS) -> LoRABatch:
    """The step's metadata, with every slot's pages drawn at random from the layer's page pool."""
    ranks = torch.full((slots,), rank, dtype=torch.int32, device="cuda")
    scales = torch.full((slots,), 2.0, dtype=torch.float32, device="cuda")
    per_slot = pages_per_slot(rank, page_rank)
    pages = torch.randperm(slots * per_slot, generator=torch.Generator().manual_seed(1)).reshape(slots, per_slot)
    return LoRABatch.build(token_slots(num_tokens, adapters, slots), ranks, scales, pages.to("cuda"))
