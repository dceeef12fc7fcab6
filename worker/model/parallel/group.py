"""A tensor-parallel rank's view of its group: who it is, and the two collectives the model runs.

A model without tensor parallelism holds no TensorParallel at all (None), so a one-device worker
never pays for a collective. On CUDA the group is NCCL's, whose collectives the decode graphs
capture; on CPU it is gloo's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int
    size: int
    # the device collectives' group; None only for a model that is measured, never run (the memory plan's meta model)
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size}: size must be >= 2, rank in [0, size)")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place; returns x."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] of every rank side by side: [N, size * C], rank 0's columns first."""
        gathered = torch.empty(self.size * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        if x.is_cuda:
            dist.all_gather_into_tensor(gathered, x.contiguous(), group=self.group)
        else:  # gloo has no all_gather_into_tensor
            dist.all_gather(list(gathered.chunk(self.size)), x.contiguous(), group=self.group)
        return gathered.view(self.size, *x.shape).transpose(0, 1).reshape(x.shape[0], -1)
