"""Plain-torch multi-LoRA: the semantics every Triton path must reproduce (and the CPU serving path).

for each token t with s = token_slots[t] >= 0, for each slice i:
    r = slot_ranks[s]
    y[t, offset_i : offset_i + N_i] += slot_scales[s] * (x[t] @ A_i[s, :r].T) @ B_i[s, :, :r].T

where A_i[s] [max_rank, K] and B_i[s] [N_i, max_rank] are slot s's rank rows of the paged weights
lora_a[i] [P, PR, K] and lora_b[i] [P, N_i, PR], through the page table (max_rank = pages_per_slot * PR):

    A_i[s][r] = lora_a[i][slot_pages[s, r // PR], r % PR]
    B_i[s][:, r] = lora_b[i][slot_pages[s, r // PR], :, r % PR]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora.metadata import LoRABatch


def slot_weights(a: torch.Tensor, b: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [max_rank, K] and B [N, max_rank] of one slot from its page table row pages [pages_per_slot]
    (int) and one slice's pages a [P, PR, K], b [P, N, PR]."""
    pages = pages.long()
    slot_a = a[pages].reshape(-1, a.shape[2])  # [pages_per_slot * PR, K], rank order
    slot_b = b[pages].transpose(0, 1).reshape(b.shape[1], -1)  # [N, pages_per_slot * PR]
    return slot_a, slot_b


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> None:
    """y [T, sum N_i] += LoRA(x [T, K]); lora_a[i] [P, PR, K], lora_b[i] [P, N_i, PR]. In place.
    Rank rows past a slot's rank (the rest of its last page, its unused page table entries) are
    never read, whatever they hold."""
    max_rank = batch.pages_per_slot * lora_a[0].shape[1]
    ranks = batch.slot_ranks.tolist()
    for slot in torch.unique(batch.token_slots).tolist():
        if slot < 0:
            continue
        rank = min(ranks[slot], max_rank)
        tokens = torch.nonzero(batch.token_slots == slot).squeeze(1)
        xs = x[tokens].float()
        offset = 0
        for a, b in zip(lora_a, lora_b, strict=True):
            width = b.shape[1]
            slot_a, slot_b = slot_weights(a, b, batch.slot_pages[slot])
            shrunk = xs @ slot_a[:rank].float().T  # [t, r]
            delta = (shrunk @ slot_b[:, :rank].float().T) * batch.slot_scales[slot]  # [t, N_i]
            y[tokens, offset : offset + width] += delta.to(y.dtype)
            offset += width
