"""The MoE forward on CUDA (or the Triton interpreter): routing → pair blocks → grouped GEMMs with
the LoRA shrink/expand of every active (adapter, expert) added into their outputs.

    gate_up = moe_gemm(x, W13)                                  [P, 2I]   P = T * top_k pairs
    gate_up += expand(shrink(x, A13), B13)                      adapters' gate_up, in place
    h = silu(gate_up[:, :I]) * gate_up[:, I:]                   [P, I]    (kernels.fused.silu_and_mul)
    y = moe_gemm(h, W2) * w                                     [P, H]    routing weight in the epilogue
    y += expand(shrink(h, A2), B2) * w                          adapters' down, in place
    out = y.view(T, top_k, H).sum(1)

Per layer: the router GEMM, top-k, one alignment by expert (align_small.py: one launch at decode
sizes), two grouped GEMMs, SiLU·up and the top-k sum; with adapters in the batch, a second alignment
by (adapter, expert) after ~5 small ops that build its groups, and the four LoRA kernels.
"""

from __future__ import annotations

import functools

import torch

from kernels.fused import silu_and_mul
from kernels.moe.align import adapter_expert_blocks, expert_blocks
from kernels.moe.configs import MoEPlan, plan_for
from kernels.moe.gemm import moe_gemm
from kernels.moe.lora_expand import moe_lora_expand
from kernels.moe.lora_shrink import moe_lora_shrink
from kernels.moe.reference import ExpertLoRA


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
) -> torch.Tensor:
    """Same contract as reference.moe_reference: x [T, H], weights float32 / ids int [T, K],
    w13 [E, 2I, H], w2 [E, H, I] → [T, H] in x's dtype. plan: the launch configurations (tests,
    the tuner); None looks them up for this GPU, shape and pair count (configs.plan_for)."""
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
    gate_up = moe_gemm(x, w13, up_blocks, top_k, plan.gemm_up)
    if lora is not None:
        lora_blocks = adapter_expert_blocks(ids, token_slots, lora.a13.shape[0], num_experts, plan.lora_block_m)
        z = moe_lora_shrink(x, lora.a13, lora_blocks, top_k, plan.shrink_up)
        # the slots hold gate and up LoRAs block-diagonally (worker/engine/moe.py): column tiles that
        # stay inside one half read only its ranks; the whole B gives the same sum otherwise
        halves = width % plan.expand_up.block_n == 0
        moe_lora_expand(gate_up, z, lora.b13, slot_scales, lora_blocks, plan.expand_up, block_diagonal=halves)
    hidden_act = silu_and_mul(gate_up)  # [P, I]
    y = moe_gemm(hidden_act, w2, down_blocks, 1, plan.gemm_down, weights=pair_weights)
    if lora is not None:
        z = moe_lora_shrink(hidden_act, lora.a2, lora_blocks, 1, plan.shrink_down)
        moe_lora_expand(y, z, lora.b2, slot_scales, lora_blocks, plan.expand_down, weights=pair_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
