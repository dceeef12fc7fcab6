"""Per-step LoRA metadata, built once per engine step and shared by every layer's LoRA call."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRABatch:
    token_slots: torch.Tensor  # int32 [T]: adapter slot of each token, -1 for the base model
    slot_ranks: torch.Tensor  # int32 [S]: rank of the adapter in each slot (0 for an empty slot)
    slot_scales: torch.Tensor  # float32 [S]: alpha/r (or alpha/sqrt(r) with rsLoRA) per slot

    @classmethod
    def build(cls, token_slots: torch.Tensor, slot_ranks: torch.Tensor, slot_scales: torch.Tensor) -> LoRABatch:
        return cls(token_slots=token_slots.to(torch.int32), slot_ranks=slot_ranks, slot_scales=slot_scales)
