"""The MoE forward on CUDA (or the Triton interpreter): routing → pair blocks → grouped GEMMs with
the LoRA shrink/expand of every active (adapter, expert) added to their outputs.

    gate_up = moe_gemm(x, W13)                                  [P, 2I]   P = T * top_k pairs
    gate_up += expand(shrink(x, A13), B13)                      adapters' gate_up
    h = silu(gate_up[:, :I]) * gate_up[:, I:]                   [P, I]    (kernels.fused.silu_and_mul)
    y = moe_gemm(h, W2) * w                                     [P, H]    routing weight in the epilogue
    y += expand(shrink(h, A2), B2) * w                          adapters' down
    out = y.view(T, top_k, H).sum(1)

Per layer: the router GEMM, top-k, one alignment by expert (one launch at decode sizes,
align_small.py; three for prefills, align_large.py), two grouped GEMMs, SiLU·up and the top-k sum.
With adapters in the batch, the alignment by (adapter, expert) and the four LoRA kernels run on a
side stream (kernels/streams.py) beside the grouped GEMMs, whose inputs are theirs:

    up to BESIDE_PAIRS pairs   the whole LoRA update beside each GEMM, into zeroed delta buffers
                               that the consumers add: silu_and_mul(gate_up, delta_up) and
                               topk_sum(y, delta_down); no LoRA kernel is on the critical path
    past BESIDE_PAIRS          the shrinks beside the GEMMs, the expands after them, in place
                               (delta buffers would cost two more passes over [P, 2I + H])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.fused import silu_and_mul
from kernels.moe.align import adapter_expert_blocks, expert_blocks
from kernels.moe.configs import MoEPlan, plan_for
from kernels.moe.gemm import moe_gemm
from kernels.moe.lora_expand import moe_lora_expand
from kernels.moe.lora_shrink import moe_lora_shrink
from kernels.moe.pair_blocks import PairBlocks
from kernels.moe.reference import ExpertLoRA
from kernels.moe.topk_sum import topk_sum
from kernels.streams import beside, join

# Up to this many pairs the LoRA work beside the GEMMs is at least as fast as inline; past it, the
# delta buffers' zeroing and extra passes cost more than the overlap saves (per-size figures for a
# Qwen3-30B-A3B layer: docs/benchmarks.md, "Figures behind code comments").
BESIDE_PAIRS = 2048


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def moe_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    lora: ExpertLoRA | None = None,
    token_slots: torch.Tensor | None = None,
    slot_scales: torch.Tensor | None = None,
    plan: MoEPlan | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.moe_reference: x [T, H], weights float32 / ids int [T, K],
    w13 [E, 2I, H], w2 [E, H, I] (fp8 with float32 scales w13_scale [E, 2I], w2_scale [E, H]) →
    [T, H] in x's dtype. plan: the launch configurations (tests, the tuner); None looks them up for
    this GPU, shape and pair count (configs.plan_for)."""
    num_tokens, top_k = ids.shape
    num_experts, two_width, hidden = w13.shape
    width = two_width // 2
    num_pairs = num_tokens * top_k
    pair_weights = weights.reshape(-1).float()

    if plan is None:  # without adapters the ranks only pick LoRA configurations nobody launches
        rank_up, rank_down = (lora.a13.shape[2], lora.a2.shape[2]) if lora is not None else (16, 16)
        plan = plan_for(_device_name(x.device), hidden, width, rank_up, rank_down, num_pairs)

    up_blocks = expert_blocks(ids, num_experts, plan.gemm_up.block_m)
    down_blocks = (
        up_blocks
        if plan.gemm_down.block_m == plan.gemm_up.block_m
        else expert_blocks(ids, num_experts, plan.gemm_down.block_m)
    )
    gemms = _BaseGemms(w13, w2, w13_scale, w2_scale, plan, up_blocks, down_blocks, top_k)
    if lora is None:
        y = gemms.down(silu_and_mul(gemms.gate_up(x)), pair_weights)
        return y.view(num_tokens, top_k, hidden).sum(dim=1)
    if token_slots is None or slot_scales is None:
        raise ValueError("moe_triton with lora needs token_slots and slot_scales")
    lora_path = _lora_beside if num_pairs <= BESIDE_PAIRS else _lora_inline
    return lora_path(x, pair_weights, ids, gemms, lora, token_slots, slot_scales, plan)


@dataclass(frozen=True, slots=True)
class _BaseGemms:
    """The layer's two grouped GEMMs over its expert weights (fp8 ones with their scales [E, N]) and
    pair blocks."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    plan: MoEPlan
    up_blocks: PairBlocks
    down_blocks: PairBlocks
    top_k: int

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → gate_up [P, 2I]."""
        return moe_gemm(x, self.w13, self.up_blocks, self.top_k, self.plan.gemm_up, scale=self.w13_scale)

    def down(self, hidden_act: torch.Tensor, pair_weights: torch.Tensor) -> torch.Tensor:
        """hidden_act [P, I] → y [P, H], each row times its pair's routing weight."""
        return moe_gemm(
            hidden_act, self.w2, self.down_blocks, 1, self.plan.gemm_down, weights=pair_weights, scale=self.w2_scale
        )


def _lora_beside(
    x: torch.Tensor,
    pair_weights: torch.Tensor,
    ids: torch.Tensor,
    gemms: _BaseGemms,
    lora: ExpertLoRA,
    token_slots: torch.Tensor,
    slot_scales: torch.Tensor,
    plan: MoEPlan,
) -> torch.Tensor:
    """The layer with each projection's LoRA delta computed on the side stream into a zeroed buffer
    while its base GEMM runs, and added by the GEMM's consumer. Arguments as moe_triton's, with
    pair_weights float32 [P] and the base GEMMs."""
    top_k = ids.shape[1]
    num_experts, two_width, hidden = gemms.w13.shape
    device = x.device
    # allocated on the main stream, where their consumers read and free them after the joins
    delta_up = torch.empty(ids.numel(), two_width, dtype=x.dtype, device=device)
    delta_down = torch.empty(ids.numel(), hidden, dtype=x.dtype, device=device)
    with beside(device):  # x, the routing and the adapters' metadata are ready
        lora_blocks = adapter_expert_blocks(ids, token_slots, lora.a13.shape[0], num_experts, plan.lora_block_m)
        delta_up.zero_()
        delta_down.zero_()
        z = moe_lora_shrink(x, lora.a13, lora_blocks, top_k, plan.shrink_up)
        moe_lora_expand(delta_up, z, lora.b13, slot_scales, lora_blocks, plan.expand_up,
                        block_diagonal=_halves(two_width, plan))  # fmt: skip
    gate_up = gemms.gate_up(x)
    join(device)
    hidden_act = silu_and_mul(gate_up, delta_up)  # [P, I]
    with beside(device):
        z = moe_lora_shrink(hidden_act, lora.a2, lora_blocks, 1, plan.shrink_down)
        moe_lora_expand(delta_down, z, lora.b2, slot_scales, lora_blocks, plan.expand_down, weights=pair_weights)
    y = gemms.down(hidden_act, pair_weights)
    join(device)
    return topk_sum(y, delta_down, top_k)


def _lora_inline(
    x: torch.Tensor,
    pair_weights: torch.Tensor,
    ids: torch.Tensor,
    gemms: _BaseGemms,
    lora: ExpertLoRA,
    token_slots: torch.Tensor,
    slot_scales: torch.Tensor,
    plan: MoEPlan,
) -> torch.Tensor:
    """The layer with each projection's LoRA shrink on the side stream while its base GEMM runs and
    the expand adding into the GEMM's output after it. Arguments as _lora_beside's."""
    num_tokens, top_k = ids.shape
    num_experts, two_width, hidden = gemms.w13.shape
    device = x.device
    with beside(device):
        lora_blocks = adapter_expert_blocks(ids, token_slots, lora.a13.shape[0], num_experts, plan.lora_block_m)
        z = moe_lora_shrink(x, lora.a13, lora_blocks, top_k, plan.shrink_up)
    gate_up = gemms.gate_up(x)
    join(device, z, lora_blocks.sorted_pairs, lora_blocks.block_groups)  # the expands read them here
    moe_lora_expand(gate_up, z, lora.b13, slot_scales, lora_blocks, plan.expand_up,
                    block_diagonal=_halves(two_width, plan))  # fmt: skip
    hidden_act = silu_and_mul(gate_up)  # [P, I]
    with beside(device):
        z = moe_lora_shrink(hidden_act, lora.a2, lora_blocks, 1, plan.shrink_down)
    y = gemms.down(hidden_act, pair_weights)
    join(device, z)
    moe_lora_expand(y, z, lora.b2, slot_scales, lora_blocks, plan.expand_down, weights=pair_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def _halves(two_width: int, plan: MoEPlan) -> bool:
    """The slots hold gate and up LoRAs block-diagonally (worker/model/moe.py): expand programs whose
    columns stay inside one half read only its ranks; the whole B gives the same sum otherwise."""
    return (two_width // 2) % (plan.expand_up.block_n * plan.expand_up.n_tiles) == 0
