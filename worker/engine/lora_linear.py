"""A linear layer that packs one or more projections into one GEMM and applies per-token LoRA.

q/k/v share an input, so do gate/up: packing them into one weight ([q; k; v] stacked along the
output) lets one GEMM (and one LoRA launch) serve the group. Each packed projection is a *slice*;
the layer knows its slices by their checkpoint / PEFT names, so both the checkpoint loader and the
adapter slots find where `q_proj` lives without a separate mapping table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from kernels.lora import LoRABatch, lora_linear
from worker.engine.weights import copy_weight

LoRAPair = tuple[torch.Tensor, torch.Tensor]  # (A [rank, in_features], B [out_features, rank])


@dataclass(frozen=True, slots=True)
class LoRASlotShape:
    """How many adapters a layer holds at once, and the rank every slot is padded to."""

    max_loras: int
    max_lora_rank: int


class LoRALinear(nn.Module):
    """y = x @ W.T (+ b), plus each token's adapter delta, for packed slices i:

        y[t, off_i : off_i + N_i] += scale[s] * (x[t] @ A_i[s].T) @ B_i[s].T    with s = token_slots[t] >= 0

    weight [sum N_i, K] (K = in_features); bias [sum N_i] or None;
    lora_a[i] [max_loras, max_lora_rank, K]; lora_b[i] [max_loras, N_i, max_lora_rank].
    An adapter of rank r < max_lora_rank fills the first r rows of A and columns of B; the rest of
    the slot stays zero, so padding adds nothing.
    """

    def __init__(
        self,
        in_features: int,
        projections: Mapping[str, int],
        *,
        bias: bool,
        slots: LoRASlotShape,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """`projections`: name → output width of each packed slice, in output order."""
        super().__init__()
        self.in_features = in_features
        self.projections = tuple(projections)
        self.out_features = tuple(projections.values())
        self.max_lora_rank = slots.max_lora_rank
        total = sum(self.out_features)
        # empty: every element is overwritten by the checkpoint, and the loader checks that it was
        self.weight = nn.Parameter(torch.empty(total, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total, dtype=dtype, device=device), requires_grad=False) if bias else None
        for name, width in projections.items():
            a = torch.zeros(slots.max_loras, slots.max_lora_rank, in_features, dtype=dtype, device=device)
            b = torch.zeros(slots.max_loras, width, slots.max_lora_rank, dtype=dtype, device=device)
            self.register_buffer(f"lora_a_{name}", a, persistent=False)
            self.register_buffer(f"lora_b_{name}", b, persistent=False)

    @property
    def lora_a(self) -> tuple[torch.Tensor, ...]:
        """Per slice: [max_loras, max_lora_rank, in_features]."""
        return tuple(self.get_buffer(f"lora_a_{name}") for name in self.projections)

    @property
    def lora_b(self) -> tuple[torch.Tensor, ...]:
        """Per slice: [max_loras, out_features_i, max_lora_rank]."""
        return tuple(self.get_buffer(f"lora_b_{name}") for name in self.projections)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """x [T, in_features] → [T, sum out_features]; `lora` None when no token uses an adapter."""
        return lora_linear(x, self.weight, self.bias, self.lora_a, self.lora_b, lora)

    def checkpoint_loaders(self, parent: str) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint tensor name → loader, for each slice's weight (and bias): `q_proj.weight` of a
        packed qkv layer under `parent` lands in rows [0, N_q) of this layer's weight."""
        loaders: dict[str, Callable[[torch.Tensor], None]] = {}
        prefix = f"{parent}." if parent else ""
        offset = 0
        for name, width in zip(self.projections, self.out_features, strict=True):
            for param_name in ("weight", "bias"):
                param = getattr(self, param_name)
                if param is not None:
                    key = f"{prefix}{name}.{param_name}"
                    loaders[key] = partial(copy_weight, param[offset : offset + width], name=key)
            offset += width
        return loaders

    def set_lora(self, slot: int, pairs: Sequence[LoRAPair | None]) -> None:
        """Overwrite `slot` with one (A, B) pair per slice, None for a slice the adapter leaves alone."""
        if len(pairs) != len(self.projections):
            raise ValueError(f"expected {len(self.projections)} LoRA pairs ({', '.join(self.projections)})")
        for name, width, a_slots, b_slots, pair in zip(
            self.projections, self.out_features, self.lora_a, self.lora_b, pairs, strict=True
        ):
            a_slots[slot].zero_()
            b_slots[slot].zero_()
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if rank > self.max_lora_rank:
                raise ValueError(f"{name}: LoRA rank {rank} exceeds the slot rank {self.max_lora_rank}")
            if tuple(a.shape) != (rank, self.in_features) or tuple(b.shape) != (width, rank):
                raise ValueError(
                    f"{name}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                    f"A [r, {self.in_features}] / B [{width}, r]"
                )
            a_slots[slot, :rank].copy_(a)
            b_slots[slot, :, :rank].copy_(b)

    def clear_lora(self, slot: int) -> None:
        """Zero `slot` in every slice, so nothing of its last adapter survives."""
        for a_slots, b_slots in zip(self.lora_a, self.lora_b, strict=True):
            a_slots[slot].zero_()
            b_slots[slot].zero_()
