"""The W4A16 GEMM as one Triton kernel (int4_reference.int4_linear_reference is the oracle):

    y[m, n] = sum_k x[m, k] * dtype((q[k, n] - zeros[k // G, n]) * scales[k // G, n])    in float32

Each program owns a [BLOCK_M, BLOCK_N] tile of y and a range of K tiles (split-K): it loads a
[BLOCK_K / 8, BLOCK_N] block of packed int32 once per K tile, spreads each int32 over its eight
rows and masks the 4-bit values out in registers, dequantizes with the
group's scale and zero point (one row of each per K tile: BLOCK_K divides the group size) and feeds
x's dtype to tl.dot. Only the 4-bit weights, their scales and x cross the memory bus: at decode
sizes that is 3.5x fewer bytes than a bf16 weight.

Split-K: at decode a [BLOCK_N]-wide column of tiles is all the parallelism there is (4096 / 64 = 64
programs for o_proj, half an H100); SPLIT_K programs share a column's K range. Each writes its
float32 partial sum into a workspace [SPLIT_K, M, N] and counts itself in on the tile's arrival
counter; the last to arrive adds the partials in split order (deterministic, whichever is last),
writes y and sets the counter back to zero for the next launch. No second kernel: a torch sum and
cast after the GEMM would add two launches per projection, about 0.5 ms per Llama-3-8B decode step
against a 1.6 ms roofline at batch 1. The counters are the weight's own (Int4Weight.arrivals: a
weight is multiplied by one step at a time). Everything the launch needs is on the device or fixed
by shapes: a decode step is CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from kernels.quant.int4_reference import PACK, Int4Weight


@dataclass(frozen=True, slots=True)
class Int4Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _int4_gemm_kernel(
    y_ptr,  # [M, N] in x's dtype, contiguous
    partials_ptr,  # float32 [SPLIT_K, M, N] (SPLIT_K > 1), contiguous
    arrivals_ptr,  # int32 [>= grid tiles], zero between launches (SPLIT_K > 1)
    x_ptr,  # [M, K], last axis contiguous
    qweight_ptr,  # int32 [K / 8, N], contiguous
    scales_ptr,  # float16 [K / G, N], contiguous
    zeros_ptr,  # float16 [K / G, N], contiguous
    M,
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_tiles = K // BLOCK_K
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, k_tiles)
    rows = tl.arange(0, BLOCK_K)
    packed_rows = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4  # where row 8 * i + j's value sits in packed row i: bits 4 * j
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(first, last):
        offs_k = tile * BLOCK_K + rows
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        # each int32 loaded once and spread over its eight rows in registers (a load of
        # offs_k // 8 would stage every int32 eight times in shared memory)
        packed_offs = (tile * (BLOCK_K // 8) + packed_rows)[:, None].to(tl.int64) * N + offs_n[None, :]
        packed = tl.load(qweight_ptr + packed_offs, mask=mask_n[None, :])  # [BLOCK_K / 8, BLOCK_N]
        nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
        q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(tl.float32)  # row 8 * i + j: packed row i, nibble j
        group_row = (tile * BLOCK_K // GROUP) * N  # < K / 32 * N: int32 suffices
        scale = tl.load(scales_ptr + group_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = ((q - zero[None, :]) * scale[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    tile_offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + tile_offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partials_ptr + pid_k.to(tl.int64) * M * N + tile_offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrival = arrivals_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:  # the last to arrive sums
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(SPLIT_K):  # in split order: the same sum whichever arrived last
                part = partials_ptr + split * M * N + tile_offsets
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")  # from L2, not a stale L1
            tl.store(y_ptr + tile_offsets, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrival, 0)  # ready for the next launch (graph replays included)


def int4_gemm(x: torch.Tensor, weight: Int4Weight, config: Int4Config | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] (float16, bfloat16 or float32; last axis contiguous) times the
    4-bit weight [N, K] transposed; `config` None: int4_config's for the shapes and this GPU."""
    m, k = x.shape
    n, weight_k = weight.shape
    if k != weight_k:
        raise ValueError(f"x [M, K={k}] does not match the weight's K={weight_k}")
    if x.stride(1) != 1:
        raise ValueError("x's last axis must be contiguous")
    for name, tensor in (("qweight", weight.qweight), ("scales", weight.scales), ("zeros", weight.zeros)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if weight.scales.shape != weight.zeros.shape or weight.scales.shape[1] != n:
        raise ValueError(
            f"scales {tuple(weight.scales.shape)} and zeros {tuple(weight.zeros.shape)} must be [K/G, N={n}]"
        )
    group = weight.group_size
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if config is None:
        config = int4_config(m, n, k, group, _sm_count(x.device))
    if group % config.block_k or config.block_k % PACK:
        raise ValueError(f"BLOCK_K={config.block_k} must divide the group size {group} and be a multiple of {PACK}")
    split = config.split_k
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partials, arrivals = y, y  # never read without a split
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        arrivals = weight.arrivals
        if grid[0] * grid[1] > arrivals.numel():
            raise ValueError(f"a split-K launch of {grid[0] * grid[1]} tiles exceeds the {arrivals.numel()} counters")
    _int4_gemm_kernel[grid](
        y,
        partials,
        arrivals,
        x,
        weight.qweight,
        weight.scales,
        weight.zeros,
        m,
        n,
        k,
        x.stride(0),
        GROUP=group,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 models get float32 products
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# decode launches aim for this many programs per SM: a memory-bound kernel needs several in flight
# per SM to keep its loads queued
_PROGRAMS_PER_SM = 2


def int4_config(m: int, n: int, k: int, group: int, sm_count: int) -> Int4Config:
    """The launch for y [m, n] = x [m, k] · W [n, k]ᵀ, reasoned from Llama-3-8B's shapes on H100/H200
    (132 SMs): qkv 6144×4096, o 4096×4096, gate_up 28672×4096, down 4096×14336.

    Decode (m <= 64) is bound by the weight's bytes: BLOCK_M covers the batch in one row of tiles
    (16, tl.dot's smallest, up to 64), BLOCK_N 64 keeps each program's packed block a few KiB, and
    BLOCK_K 128 (one group: one scale and zero row per tile) gives 2 KiB of 4-bit loads per K tile
    in flight per program. Split-K fills the GPU where the N tiles alone do not (two programs per
    SM, each split keeping four K tiles or more): o (64 column tiles, 32 K tiles) and down (64, 112)
    split 8 ways, qkv (96) 4, gate_up (448) not at all. The float32 partial sums of a split cost
    split × M × N × 8 bytes (written, then read back, mostly from L2): 2 MiB for o at batch 8,
    beside 8 MiB of 4-bit weight; splits stop before the partials outweigh the weight.

    Larger batches (64 < m <= 256: decode of 128 or 256 sequences) take 64-row tiles, 128 wide,
    split the same way as far as the partials stay within the weight's bytes (o at batch 128: 64
    tiles, split 2). Prefill (m > 256) is bound by
    compute: 128×128 tiles with BLOCK_K 64, the usual Hopper tensor-core shape for Triton, with the
    dequantization hidden under the MMA by software pipelining (num_stages 4), and no split (its
    partials would be megabytes). cuBLAS on a dequantized copy would be faster per FLOP, but would
    cost a bf16 copy of the largest weight (235 MB for gate_up) in every step.
    """
    if m <= 64:
        block_m, block_n, block_k, warps = (16 if m <= 16 else (32 if m <= 32 else 64)), 64, min(128, group), 4
    elif m <= 256:
        block_m, block_n, block_k, warps = 64, 128, min(64, group), 4
    else:
        return Int4Config(block_m=128, block_n=128, block_k=min(64, group), split_k=1, num_warps=8, num_stages=4)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_tiles = k // block_k
    split = 1
    # powers of two, each split keeping at least four K tiles to pipeline over, and the float32
    # partials (written, then read back: 8 bytes an output per split) no more bytes than the 4-bit weight
    while (
        tiles * split < _PROGRAMS_PER_SM * sm_count
        and split * 2 * 4 <= k_tiles
        and split * 2 * m * 16 <= k
        and split < 8
    ):
        split *= 2
    return Int4Config(block_m, block_n, block_k, split_k=split, num_warps=warps, num_stages=4)
