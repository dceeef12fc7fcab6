"""Random multi-LoRA problems and their reference results, shared by the LoRA kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora import LoRABatch
from kernels.lora.reference import add_lora_reference


@dataclass
class LoRACase:
    x: torch.Tensor  # [T, K]
    weight: torch.Tensor  # [sum N_i, K]
    bias: torch.Tensor  # [sum N_i]
    lora_a: list[torch.Tensor]  # [P, PR, K] per slice
    lora_b: list[torch.Tensor]  # [P, N_i, PR] per slice
    batch: LoRABatch

    @property
    def width(self) -> int:
        return self.weight.shape[0]

    def delta(self, y: torch.Tensor) -> torch.Tensor:
        """y + the LoRA delta, by the reference, in float32 on the CPU."""
        out = y.float().cpu().clone()
        batch = self.batch
        batch = LoRABatch.build(
            *(t.cpu() for t in (batch.token_slots, batch.slot_ranks, batch.slot_scales, batch.slot_pages))
        )
        add_lora_reference(
            out,
            self.x.float().cpu(),
            [a.float().cpu() for a in self.lora_a],
            [b.float().cpu() for b in self.lora_b],
            batch,
        )
        return out

    def linear(self) -> torch.Tensor:
        """x · Wᵀ + bias + the LoRA delta, by the reference, in float32 on the CPU."""
        return self.delta(self.x.float().cpu() @ self.weight.float().cpu().T + self.bias.float().cpu())


def identity_pages(num_slots: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The unpaged layout's page table, int32 [S, 1]: slot s is page s (of PR = max_rank rows)."""
    return torch.arange(num_slots, dtype=torch.int32, device=device)[:, None]


def scrambled_pages(
    ranks: list[int], page_rank: int, pages_per_slot: int, num_pages: int, gen: torch.Generator
) -> torch.Tensor:
    """int32 [S, pages_per_slot]: each slot's cdiv(rank, PR) pages dealt round-robin over the slots
    (in a random slot order each round) from the top of the pool down, so a slot's pages are
    neither adjacent nor in increasing order; the entries past them hold random pages of the pool
    (other slots' pages included), which kernels must never read."""
    needed = [-(-rank // page_rank) for rank in ranks]
    if sum(needed) > num_pages:
        raise ValueError(f"{sum(needed)} pages needed, the pool has {num_pages}")
    table = torch.randint(0, num_pages, (len(ranks), pages_per_slot), generator=gen, dtype=torch.int32)
    page = num_pages - 1
    for j in range(pages_per_slot):
        for slot in torch.randperm(len(ranks), generator=gen).tolist():
            if j < needed[slot]:
                table[slot, j] = page
                page -= 1
    return table


def make_case(
    num_tokens: int,
    k: int,
    widths: list[int],
    ranks: list[int],
    *,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    base_fraction: float = 0.2,
    max_rank: int | None = None,
    page_rank: int | None = None,
    spare_pages: int = 2,
    seed: int = 0,
) -> LoRACase:
    """Tokens drawn uniformly over the slots (a fraction on the base model); ranks[s] per slot.

    page_rank None: the unpaged layout (one page of max_rank rows per slot, identity page table).
    Otherwise pages of page_rank rows, max_rank rounded up to whole pages, a pool of exactly the
    pages the slots need plus `spare_pages`, and a scrambled page table (scrambled_pages).
    Rank rows past each slot's rank, and the spare pages, hold garbage, as a stale pool page would:
    kernels must honour slot_ranks rather than rely on zero padding.
    """
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(ranks)
    max_rank = max_rank or max(ranks)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    slots[torch.rand(num_tokens, generator=gen) < base_fraction] = -1
    scales = torch.rand(num_slots, generator=gen) + 0.5
    if page_rank is None:
        page_rank, num_pages, slot_pages = max_rank, num_slots, identity_pages(num_slots)
    else:
        pages_per_slot = -(-max_rank // page_rank)
        max_rank = pages_per_slot * page_rank
        num_pages = sum(-(-rank // page_rank) for rank in ranks) + spare_pages
        slot_pages = scrambled_pages(ranks, page_rank, pages_per_slot, num_pages, gen)
    batch = LoRABatch.build(
        slots.to(device),
        torch.tensor(ranks, dtype=torch.int32, device=device),
        scales.to(device),
        slot_pages.to(device),
    )
    return LoRACase(
        x=rand(num_tokens, k),
        weight=rand(sum(widths), k, scale=k**-0.5),
        bias=rand(sum(widths)),
        lora_a=[rand(num_pages, page_rank, k, scale=k**-0.5) for _ in widths],
        lora_b=[rand(num_pages, n, page_rank, scale=max_rank**-0.5) for n in widths],
        batch=batch,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere (an unwritten poisoned element) fails every bound."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))
