"""MoE-LoRA shrink: z = a · A[slot, expert]ᵀ for every routed pair whose token has an adapter.

Semantics:
    for each pair p of token t = p // rows_div (when a holds tokens), slot s >= 0, expert e:
        sum over the split axis of z[:, p, :R] == a[p // rows_div] @ A[s, e].T     (fp32, unscaled)
    rows of pairs without an adapter are never written (and never read).

Blocks come from align.adapter_expert_blocks: group g = s * E + e, which is also the row of A
viewed as [S * E, R, K], so the adapter is a coordinate of the block axis and a program needs no
lookup to find its weights. Only (adapter, expert) pairs present in the batch get blocks: an
explicit adapter grid axis would launch S programs per block, nearly all empty at decode sizes.

Grid: (SPLIT_K, blocks). The skinny shrink (R ≤ 128 outputs) has too few blocks at decode to
fill the GPU, so the K reduction is split; partial sums stay separate (no atomics, no zero fill)
and the expand adds them as it loads z. Blocks of one group are adjacent, so the programs that
re-read A[s, e] run together and find it in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.configs import ShrinkConfig
from kernels.moe.pair_blocks import PairBlocks


def rank_pad(rank: int) -> int:
    """tl.dot needs at least 16 columns and a power of two."""
    return max(16, triton.next_power_of_2(rank))


@triton.jit(do_not_specialize=["num_pairs", "z_stride_split"])
def _moe_shrink_kernel(
    a_ptr, lora_a_ptr, z_ptr, sorted_pairs_ptr, block_groups_ptr,
    num_pairs, rank, k_size, rows_div, split_k,
    a_stride, z_stride_split,
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid_k = tl.program_id(0)
    block = tl.program_id(1)
    group = tl.load(block_groups_ptr + block)
    if group < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = (pairs // rows_div).to(tl.int64)
    r = tl.arange(0, R_PAD)
    r_ok = r < rank
    k_offs = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * a_stride + k_offs[None, :]  # [BLOCK_M, BLOCK_K]
    lora_ptrs = lora_a_ptr + group.to(tl.int64) * rank * k_size + r[None, :] * k_size + k_offs[:, None]
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    k_per_split = tl.cdiv(k_size, split_k * BLOCK_K) * BLOCK_K
    for k in range(pid_k * k_per_split, (pid_k + 1) * k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(a_ptrs + k, mask=pair_ok[:, None], other=0.0)
            lora = tl.load(lora_ptrs + k, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = (k + k_offs) < k_size
            x = tl.load(a_ptrs + k, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            lora = tl.load(lora_ptrs + k, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, lora)
    z_ptrs = z_ptr + pid_k * z_stride_split + pairs.to(tl.int64)[:, None] * R_PAD + r[None, :]
    tl.store(z_ptrs, acc, mask=pair_ok[:, None])


def moe_lora_shrink(
    a: torch.Tensor, lora_a: torch.Tensor, blocks: PairBlocks, rows_div: int, config: ShrinkConfig
) -> torch.Tensor:
    """a [T or P, K] (unit column stride), lora_a [S, E, R, K] contiguous →
    z float32 [SPLIT_K, P, R_PAD] (partial sums, see the module docstring)."""
    if blocks.block_m != config.block_m:
        raise ValueError(f"pair blocks of {blocks.block_m} rows, config wants {config.block_m}")
    _, _, rank, k_size = lora_a.shape
    if a.shape[1] != k_size or a.stride(1) != 1 or not lora_a.is_contiguous():
        raise ValueError(f"a {tuple(a.shape)} and LoRA A {tuple(lora_a.shape)} do not chain (or are not contiguous)")
    r_pad = rank_pad(rank)
    z = torch.empty(config.split_k, blocks.num_pairs, r_pad, dtype=torch.float32, device=a.device)
    if blocks.num_pairs == 0:
        return z
    _moe_shrink_kernel[(config.split_k, blocks.max_blocks)](
        a, lora_a, z, blocks.sorted_pairs, blocks.block_groups,
        blocks.num_pairs, rank, k_size, rows_div, config.split_k,
        a.stride(0), z.stride(0),
        R_PAD=r_pad, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        EVEN_K=k_size % (config.block_k * config.split_k) == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return z
