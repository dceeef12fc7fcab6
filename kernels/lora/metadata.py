"""Per-step LoRA metadata, built once per engine step and shared by every layer's LoRA call.

Tokens are grouped by adapter slot so a kernel tile never mixes adapters: group g < S holds the
tokens of slot g (empty when the slot's rank is 0), group S ("no LoRA") holds base-model tokens and
tokens of rank-0 slots. Everything here is computed with device ops of fixed output size, so
building it never waits on the GPU and can be captured in a CUDA graph.

Adapter weights live in pages of PR rank rows (S-LoRA's unified paging, see tiles.py): slot_pages
is the page table, row s listing the pages of slot s in rank order, so rank index r of slot s is
row r % PR of page slot_pages[s, r // PR]. A slot holds at most max_rank = pages_per_slot * PR.

    token_slots    = [ 2, -1,  0,  2]          (S = 3, all ranks > 0)
    sorted_tokens  = [ 2,  0,  3,  1]          tokens ordered by group, stable
    group_counts   = [ 1,  0,  2,  1]          [S + 1]; a group's tokens start at the sum of the counts before it
    active_slots   = [ 0,  2, -1]              [S], slots with tokens, ascending, then -1
    num_active     = [ 2]
    sorted_ranks   = [16, 16, 16,  0]          rank at each sorted position, 0 without LoRA; with
                                               sorted_slots, sorted_scales and sorted_pages (the page
                                               table row of each position), what decode kernels read
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoRABatch:
    token_slots: torch.Tensor  # int32 [T]: adapter slot of each token, -1 for the base model
    slot_ranks: torch.Tensor  # int32 [S]: rank of the adapter in each slot (0 for an empty slot)
    slot_scales: torch.Tensor  # float32 [S]: alpha/r (or alpha/sqrt(r) with rsLoRA) per slot
    # int32 [S, pages_per_slot]: page table, slot s's rank rows [j * PR, (j + 1) * PR) in page
    # slot_pages[s, j]; entries past cdiv(slot_ranks[s], PR) hold any page in [0, P), never read
    slot_pages: torch.Tensor
    sorted_tokens: torch.Tensor = field(init=False)  # int32 [T]: token ids grouped by slot, base last
    group_counts: torch.Tensor = field(init=False)  # int32 [S + 1]: tokens per group (see above)
    active_slots: torch.Tensor = field(init=False)  # int32 [S]: slots with tokens first, then -1
    num_active: torch.Tensor = field(init=False)  # int32 [1]: how many entries of active_slots are set
    sorted_slots: torch.Tensor = field(init=False)  # int32 [T]: slot at each sorted position, -1 without LoRA
    sorted_ranks: torch.Tensor = field(init=False)  # int32 [T]: its rank, 0 without LoRA
    sorted_scales: torch.Tensor = field(init=False)  # float32 [T]: its scale
    sorted_pages: torch.Tensor = field(init=False)  # int32 [T, pages_per_slot]: its page table row, unread without LoRA

    def __post_init__(self) -> None:
        if self.token_slots.dim() != 1 or self.slot_ranks.dim() != 1 or self.slot_scales.dim() != 1:
            raise ValueError("token_slots, slot_ranks and slot_scales must be 1-D")
        if self.slot_ranks.shape != self.slot_scales.shape:
            raise ValueError(
                f"slot_ranks {tuple(self.slot_ranks.shape)} and slot_scales "
                f"{tuple(self.slot_scales.shape)} must describe the same slots"
            )
        if self.slot_pages.dim() != 2 or self.slot_pages.shape[0] != self.slot_ranks.shape[0]:
            raise ValueError(
                f"slot_pages {tuple(self.slot_pages.shape)} must be [S={self.slot_ranks.shape[0]}, pages_per_slot]"
            )
        if self.slot_pages.shape[1] == 0:
            raise ValueError("slot_pages must give every slot at least one page")
        device = self.token_slots.device
        self.token_slots = self.token_slots.to(torch.int32)
        self.slot_ranks = self.slot_ranks.to(device=device, dtype=torch.int32)
        self.slot_scales = self.slot_scales.to(device=device, dtype=torch.float32)
        # no copy when the caller's table is already an int32 tensor on the device (a CUDA graph
        # captured over this build then reads the caller's persistent table)
        self.slot_pages = self.slot_pages.to(device=device, dtype=torch.int32).contiguous()
        num_slots = self.slot_ranks.shape[0]

        slots = self.token_slots.long()
        rank_of_token = self.slot_ranks[slots.clamp(min=0)] if num_slots else torch.zeros_like(slots)
        group = torch.where((slots >= 0) & (rank_of_token > 0), slots, num_slots)
        sorted_group, order = torch.sort(group, stable=True)
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        counts.index_add_(0, group, torch.ones_like(group, dtype=torch.int32))
        self.sorted_tokens = order.to(torch.int32)
        self.group_counts = counts
        has_lora = sorted_group < num_slots
        self.sorted_slots = torch.where(has_lora, sorted_group, -1).to(torch.int32)
        self.sorted_ranks = torch.where(has_lora, rank_of_token[order], 0).to(torch.int32)
        scale_of_token = self.slot_scales[slots.clamp(min=0)] if num_slots else torch.zeros(slots.shape, device=device)
        self.sorted_scales = torch.where(has_lora, scale_of_token[order], 0.0)
        self.sorted_pages = (
            self.slot_pages[self.sorted_slots.long().clamp(min=0)]
            if num_slots
            else torch.zeros((slots.shape[0], self.pages_per_slot), dtype=torch.int32, device=device)
        )

        active = counts[:num_slots] > 0
        _, slot_order = torch.sort((~active).to(torch.int8), stable=True)
        self.active_slots = torch.where(active[slot_order], slot_order, -1).to(torch.int32)
        self.num_active = active.sum(dtype=torch.int32).reshape(1)

    @classmethod
    def build(
        cls, token_slots: torch.Tensor, slot_ranks: torch.Tensor, slot_scales: torch.Tensor, slot_pages: torch.Tensor
    ) -> LoRABatch:
        return cls(token_slots=token_slots, slot_ranks=slot_ranks, slot_scales=slot_scales, slot_pages=slot_pages)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_ranks.shape[0]

    @property
    def pages_per_slot(self) -> int:
        return self.slot_pages.shape[1]
