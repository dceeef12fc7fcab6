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
    lora_a: list[torch.Tensor]  # [S, R, K] per slice
    lora_b: list[torch.Tensor]  # [S, N_i, R] per slice
    batch: LoRABatch

    @property
    def width(self) -> int:
        return self.weight.shape[0]

    def delta(self, y: torch.Tensor) -> torch.Tensor:
        """y + the LoRA delta, by the reference, in float32 on the CPU."""
        out = y.float().cpu().clone()
        batch = LoRABatch.build(
            *(t.cpu() for t in (self.batch.token_slots, self.batch.slot_ranks, self.batch.slot_scales))
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
    seed: int = 0,
) -> LoRACase:
    """Tokens drawn uniformly over the slots (a fraction on the base model); ranks[s] per slot.

    Rows of A and columns of B past each slot's rank hold garbage, as a stale pool page would:
    kernels must honour slot_ranks rather than rely on zero padding.
    """
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(ranks)
    max_rank = max_rank or max(ranks)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    slots[torch.rand(num_tokens, generator=gen) < base_fraction] = -1
    batch = LoRABatch.build(
        slots.to(device),
        torch.tensor(ranks, dtype=torch.int32, device=device),
        (torch.rand(num_slots, generator=gen) + 0.5).to(device),
    )
    return LoRACase(
        x=rand(num_tokens, k),
        weight=rand(sum(widths), k, scale=k**-0.5),
        bias=rand(sum(widths)),
        lora_a=[rand(num_slots, max_rank, k, scale=k**-0.5) for _ in widths],
        lora_b=[rand(num_slots, n, max_rank, scale=max_rank**-0.5) for n in widths],
        batch=batch,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere (an unwritten poisoned element) fails every bound."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))
