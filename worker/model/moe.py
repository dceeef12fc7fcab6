"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral) with every expert's adapter slots.

Experts are held stacked, as the kernels read them: gate|up as w13 [E, 2I, H], down as w2 [E, H, I]
(filled from the checkpoint's per-expert `experts.{e}.gate_proj.weight` …), served with
--quantization fp8 in fp8 with float32 per-output-channel scales w13_scale [E, 2I] / w2_scale [E, H]
(W8A16: quantized at load, or a pre-quantized checkpoint's fp8 experts and their `weight_scale`s
taken as they are; worker/model/fp8_weights.py, as for the dense projections). Each adapter slot holds
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
from kernels.quant import FP8_DTYPE
from shared.model_info import EXPERT_PROJECTIONS, MOE_BLOCK, ModelInfo
from worker.model.fp8_weights import BlockScaledFP8, copy_fp8, copy_scale, quantize_into
from worker.model.lora_linear import LoRAPages
from worker.model.parallel.sharding import ModelShard, Split
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

        def empty(*shape: int, of: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=of, device=device), requires_grad=False)

        fp8 = info.quantization == "fp8"
        self.router = empty(experts, hidden)
        self.w13 = empty(experts, 2 * width, hidden, of=FP8_DTYPE if fp8 else dtype)
        self.w2 = empty(experts, hidden, width, of=FP8_DTYPE if fp8 else dtype)
        self.w13_scale = empty(experts, 2 * width, of=torch.float32) if fp8 else None
        self.w2_scale = empty(experts, hidden, of=torch.float32) if fp8 else None
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
        scales = {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale}
        if lora is None:
            out = moe_forward(hidden, weights, ids, self.w13, self.w2, **scales)
        else:
            slots = ExpertLoRA(self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2)
            out = moe_forward(
                hidden, weights, ids, self.w13, self.w2, slots, lora.token_slots, lora.slot_scales, **scales
            )
        return out if self.shard is None else self.shard.tp.all_reduce(out)

    def checkpoint_loaders(
        self, layer_prefix: str, *, prequantized: bool = False
    ) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint name → loader for the router and every expert's three projections, named as
        the family's checkpoints name them (`model.layers.3.mlp.experts.7.gate_proj.weight`). fp8
        experts quantize a plain checkpoint's weights as they load, or (`prequantized`) take the
        checkpoint's fp8 weight and its `weight_scale` (one per tensor or per output channel), or
        quantize them again per row from a block-wise checkpoint's (BlockScaledFP8); a
        tensor-parallel rank's loaders take its part of each expert's projection."""
        block = f"{layer_prefix}.{MOE_BLOCK[self.info.architecture]}"
        gate, up, down = EXPERT_PROJECTIONS[self.info.architecture]
        width = self.width
        loaders = {f"{block}.gate.weight": partial(copy_weight, self.router, name=f"{block}.gate.weight")}
        parts = {
            gate: (self.w13, self.w13_scale, slice(0, width)),
            up: (self.w13, self.w13_scale, slice(width, None)),
            down: (self.w2, self.w2_scale, slice(None)),
        }
        for expert in range(self.info.num_experts):
            for projection, (stack, scales, rows) in parts.items():
                key = f"{block}.experts.{expert}.{projection}"
                target, scale = stack[expert, rows], None if scales is None else scales[expert, rows]
                split = self.shard.split(f"experts.{projection}") if self.shard is not None else None
                if scale is not None and prequantized and self.info.weight_scale_block:
                    blocks = BlockScaledFP8(target, scale, self.info.weight_scale_block, name=key, split=split)
                    loaders |= {f"{key}.weight": blocks.load_weight, f"{key}.weight_scale": blocks.load_scales}
                    continue
                projection_loaders = _projection_loaders(key, target, scale, prequantized=prequantized)
                if split is not None:
                    projection_loaders = {
                        name: partial(_load_part, loader, split) for name, loader in projection_loaders.items()
                    }
                loaders.update(projection_loaders)
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


def _projection_loaders(
    key: str, weight: torch.Tensor, scale: torch.Tensor | None, *, prequantized: bool
) -> dict[str, Callable[[torch.Tensor], None]]:
    """The loaders of one expert's projection `key` into its rows of the stacked `weight` [N, K] and,
    fp8, of the float32 `scale` [N]."""
    if scale is None:
        return {f"{key}.weight": partial(copy_weight, weight, name=f"{key}.weight")}
    if not prequantized:
        return {f"{key}.weight": partial(quantize_into, weight, scale, name=f"{key}.weight")}
    return {
        f"{key}.weight": partial(copy_fp8, weight, name=f"{key}.weight"),
        f"{key}.weight_scale": partial(copy_scale, scale, name=f"{key}.weight_scale"),
    }


def _load_part(loader: Callable[[torch.Tensor], None], split: Split, tensor: torch.Tensor) -> None:
    """`loader` fed with a tensor-parallel rank's part of a whole expert tensor: the weight's rows or
    columns, a per-output-channel scale's entries where the outputs are split (a per-tensor scale whole)."""
    if tensor.dim() == 2:
        loader(split.take(tensor))
    else:
        loader(tensor if tensor.numel() == 1 else split.take_vector(tensor))
