"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral) with every expert's adapter slots.

Experts are held stacked, as the kernels read them: gate|up as w13 [E, 2I, H], down as w2 [E, H, I]
(filled from the checkpoint's per-expert `experts.{e}.gate_proj.weight` …). Each adapter slot holds
every expert's LoRA: gate_up A [S, E, 2R, H] / B [S, E, 2I, 2R], down A [S, E, R, I] / B [S, E, H, R].
gate_up gets twice the slot rank because an adapter's gate and up LoRAs (rank r each) are stacked
block-diagonally into one rank-2r LoRA of the packed projection: A = [A_gate; A_up],
B = [[B_gate, 0], [0, B_up]], so one shrink and one expand serve both (the adapter pool's slot writer
fills them through `lora_slot_views`).

Under tensor parallelism every rank holds every expert, each with its share of the width (gate/up
rows, down columns: parallel/sharding.py, `info` is the rank's), and the block's output, LoRA
deltas included, is summed over the ranks by one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from kernels.lora import LoRABatch
from kernels.moe import ExpertLoRA, moe_forward, route
from shared.model_info import EXPERT_PROJECTIONS, MOE_BLOCK, ModelInfo
from worker.model.lora_linear import LoRAPages
from worker.model.parallel.sharding import ModelShard
from worker.model.weights import copy_weight


class MoEBlock(nn.Module):
    def __init__(
        self,
        info: ModelInfo,
        *,
        pages: LoRAPages,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ModelShard | None = None,
    ) -> None:
        """Expert LoRA is not paged: the model gives an MoE model pages of its whole max rank, one per
        adapter, and the expert buffers below are indexed by that page (the adapter's slot)."""
        super().__init__()
        self.info = info
        self.shard = shard
        experts, hidden, width = info.num_experts, info.hidden_size, info.moe_intermediate_size
        rank, num_slots = pages.page_rank, pages.num_pages
        self.top_k = info.num_experts_per_tok
        self.renormalize = info.norm_topk_prob
        self.width = width
        self.max_lora_rank = rank

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router = empty(experts, hidden)
        self.w13 = empty(experts, 2 * width, hidden)
        self.w2 = empty(experts, hidden, width)
        zeros = partial(torch.zeros, dtype=dtype, device=device)
        self.lora_a13: torch.Tensor
        self.lora_b13: torch.Tensor
        self.lora_a2: torch.Tensor
        self.lora_b2: torch.Tensor
        self.register_buffer("lora_a13", zeros(num_slots, experts, 2 * rank, hidden), persistent=False)
        self.register_buffer("lora_b13", zeros(num_slots, experts, 2 * width, 2 * rank), persistent=False)
        self.register_buffer("lora_a2", zeros(num_slots, experts, rank, width), persistent=False)
        self.register_buffer("lora_b2", zeros(num_slots, experts, hidden, rank), persistent=False)

    def forward(self, hidden: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """[T, hidden_size] → [T, hidden_size]; `lora` None when no token uses an adapter."""
        weights, ids = route(hidden @ self.router.T, self.top_k, self.renormalize)
        if lora is None:
            out = moe_forward(hidden, weights, ids, self.w13, self.w2)
        else:
            slots = ExpertLoRA(self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2)
            out = moe_forward(hidden, weights, ids, self.w13, self.w2, slots, lora.token_slots, lora.slot_scales)
        return out if self.shard is None else self.shard.tp.all_reduce(out)

    def checkpoint_loaders(self, layer_prefix: str) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint name → loader for the router and every expert's three projections, named as
        the family's checkpoints name them (`model.layers.3.mlp.experts.7.gate_proj.weight`); a
        tensor-parallel rank's loaders take its part of each expert's projection."""
        block = f"{layer_prefix}.{MOE_BLOCK[self.info.architecture]}"
        gate, up, down = EXPERT_PROJECTIONS[self.info.architecture]
        width = self.width
        loaders = {f"{block}.gate.weight": partial(copy_weight, self.router, name=f"{block}.gate.weight")}
        for expert in range(self.info.num_experts):
            prefix = f"{block}.experts.{expert}"
            targets = {gate: self.w13[expert, :width], up: self.w13[expert, width:], down: self.w2[expert]}
            for projection, target in targets.items():
                key = f"{prefix}.{projection}.weight"
                loaders[key] = partial(copy_weight, target, name=key)
                if self.shard is not None:
                    take = self.shard.split(f"experts.{projection}").take
                    loaders[key] = partial(_load_part, loaders[key], take)
        return loaders

    def lora_slot_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`experts.{projection}` → (A, B) views of the slot buffers an adapter's per-expert LoRA of
        that projection lands in: A [S, max_rank, E, in] (ranks on dim 1), B [S, E, out, max_rank]
        (ranks last); what the adapter pool's slot writer copies into and zeroes."""
        rank, width = self.max_lora_rank, self.width
        gate, up, down = EXPERT_PROJECTIONS[self.info.architecture]
        return {
            f"experts.{gate}": (self.lora_a13[:, :, :rank].transpose(1, 2), self.lora_b13[:, :, :width, :rank]),
            f"experts.{up}": (self.lora_a13[:, :, rank:].transpose(1, 2), self.lora_b13[:, :, width:, rank:]),
            f"experts.{down}": (self.lora_a2.transpose(1, 2), self.lora_b2),
        }


def _load_part(
    loader: Callable[[torch.Tensor], None], take: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor
) -> None:
    loader(take(tensor))
