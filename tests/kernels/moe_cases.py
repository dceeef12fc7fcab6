"""Random MoE layers with adapter slots, shared by the CPU (interpreter) and GPU kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe.reference import ExpertLoRA


@dataclass(frozen=True)
class MoECase:
    x: torch.Tensor  # [T, H]
    router: torch.Tensor  # [E, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    lora: ExpertLoRA
    token_slots: torch.Tensor  # int32 [T]
    slot_scales: torch.Tensor  # float32 [S]


def make_moe_case(
    num_tokens: int,
    *,
    hidden: int,
    width: int,
    num_experts: int,
    slot_ranks: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> MoECase:
    """Slot s holds an adapter of rank slot_ranks[s] (0: empty) on gate and up (stacked as one
    block-diagonal LoRA of twice the rank, as the engine's slots hold them) and down; tokens pick
    slots at random, -1 included, except token 0, which always uses slot 0 (so every case has
    adapter work when slot 0 is not empty)."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: GPU-sized cases are large
    num_slots, max_rank = len(slot_ranks), max(slot_ranks)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    a13 = rand(num_slots, num_experts, 2 * max_rank, hidden, std=hidden**-0.5)
    b13 = rand(num_slots, num_experts, 2 * width, 2 * max_rank, std=0.2)
    a2 = rand(num_slots, num_experts, max_rank, width, std=width**-0.5)
    b2 = rand(num_slots, num_experts, hidden, max_rank, std=0.2)
    # as worker/model/moe.py lays slots out: gate ranks [0, R), up ranks [R, 2R), B block-diagonal
    b13[:, :, :width, max_rank:] = 0
    b13[:, :, width:, :max_rank] = 0
    for slot, rank in enumerate(slot_ranks):  # slots are zero past their adapter's rank
        for first in (0, max_rank):
            a13[slot, :, first + rank : first + max_rank] = 0
            b13[slot, :, :, first + rank : first + max_rank] = 0
        a2[slot, :, rank:] = 0
        b2[slot, :, :, rank:] = 0
    return MoECase(
        x=rand(num_tokens, hidden, std=1.0),
        router=rand(num_experts, hidden, std=hidden**-0.5),
        w13=rand(num_experts, 2 * width, hidden, std=hidden**-0.5),
        w2=rand(num_experts, hidden, width, std=width**-0.5),
        lora=ExpertLoRA(a13, b13, a2, b2),
        token_slots=torch.randint(-1, num_slots, (num_tokens,), generator=gen, device=device)
        .index_fill_(0, torch.tensor([0], device=device), 0)
        .to(torch.int32),
        slot_scales=torch.rand(num_slots, generator=gen, device=device) + 0.5,
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
