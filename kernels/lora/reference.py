"""Plain-torch multi-LoRA: the semantics every Triton path must reproduce.

for each token t with s = token_slots[t] >= 0, for each slice i:
    r = slot_ranks[s]
    y[t, offset_i : offset_i + N_i] += slot_scales[s] * (x[t] @ A_i[s, :r].T) @ B_i[s, :, :r].T
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora.metadata import LoRABatch


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: LoRABatch,
) -> None:
    """y [T, sum N_i] += LoRA(x [T, K]); lora_a[i] [S, R, K], lora_b[i] [S, N_i, R]. In place."""
    max_rank = lora_a[0].shape[1]
    rank_ids = torch.arange(max_rank, device=x.device)
    for slot in torch.unique(batch.token_slots).tolist():
        if slot < 0:
            continue
        tokens = torch.nonzero(batch.token_slots == slot).squeeze(1)
        xs = x[tokens].float()
        # zero the rank columns past this adapter's rank: slots are padded to the pool's max rank
        rank_mask = (rank_ids < batch.slot_ranks[slot]).float()
        offset = 0
        for a, b in zip(lora_a, lora_b, strict=True):
            width = b.shape[1]
            shrunk = (xs @ a[slot].float().T) * rank_mask  # [t, R]
            delta = (shrunk @ b[slot].float().T) * batch.slot_scales[slot]  # [t, N_i]
            y[tokens, offset : offset + width] += delta.to(y.dtype)
            offset += width
