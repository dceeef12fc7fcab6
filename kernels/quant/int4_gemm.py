"""The W4A16 GEMM as Triton kernels (int4_reference.int4_linear_reference is the oracle):

    y[m, n] = sum_k x[m, k] * w[k, n],   w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]   (affine)
                                         w[k, n] = codebook[q[k, n]] * scales[k // G, n]             (codebook)

w is dequantized in float32 and the products summed in float32; a constexpr (DEQUANT, chosen by
`dequantization`) picks the dequantization, everything else is one code. Two kernels, one per regime:

- `_int4_gemv_kernel` (one row: decode of one sequence) multiplies on the CUDA cores: a tensor-core
  tile would be 16 rows of which 15 are padding, and the tensor cores' operand layout costs a
  shuffle of the dequantized tile through shared memory. Products are in float32, w not rounded to
  x's dtype: within one 16-bit rounding of the reference. (Several rows per program, each
  multiplied by the tile in turn, measured slower than the tensor-core kernel from 4 rows on:
  docs/benchmarks.md, "4-bit weights".)
- `_int4_gemm_kernel` (more rows) feeds x's dtype to tl.dot: each program owns a [BLOCK_M, BLOCK_N]
  tile of y, loads a [BLOCK_K / 8, BLOCK_N] block of packed int32 once per K tile, spreads each
  int32 over its eight rows in registers, dequantizes with the group's scale and zero point (one row
  of each per K tile: BLOCK_K divides the group size) and rounds w to x's dtype, as the reference.

Affine weights turn a nibble into a float without an integer-to-float conversion (a quarter-rate
instruction on Hopper, which would bound the kernel below the memory roofline): the nibble's bits
OR-ed into the mantissa of 2**23 are the float 2**23 + q, and subtracting 2**23 + zero (both exact in
float32) leaves q - zero exactly. Codebook weights (NF4, FP4) look their levels up in registers
(codebook_lookup.py): one inline-PTX call turns a packed int32 into its eight float32 levels by byte
permutes over the table's bytes (in registers and immediates), no memory access per weight, bit for bit
the table's.
A gathered load per weight from the 16 floats in memory (in L1) made NF4 decode 6x slower than int4
(docs/benchmarks.md, "NF4 and int4 decode on the H100"); that gather stays for the interpreter,
which runs no inline assembly, and for a codebook of other levels (DEQUANT "table").
Only the 4-bit weights, their scales and x cross the memory bus: at decode sizes that is 3.5x fewer
bytes than a bf16 weight (codebook weights, a float32 scale per block of 64: 3.6x).

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

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from kernels.quant.codebook_lookup import lookup_levels
from kernels.quant.int4_reference import PACK, Int4Weight


@dataclass(frozen=True, slots=True)
class Int4Config:
    """A launch: tile sizes, the K split, the compiler's warps and stages, and the kernel (`gemv`: the
    CUDA-core kernel for one row)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    gemv: bool = False


MAGIC = tl.constexpr(0x4B000000)  # the bits of float32 2**23: OR-ed with a nibble q, the float 2**23 + q
MAGIC_VALUE = tl.constexpr(8388608.0)  # 2**23


@triton.jit
def _dequantize_tile(qweight_ptr, scales_ptr, zeros_ptr, codebook_ptr, tile, offs_n, mask_n, N,
                     GROUP: tl.constexpr, BLOCK_K: tl.constexpr, DEQUANT: tl.constexpr):  # fmt: skip
    """float32 [BLOCK_K / 8, 8, BLOCK_N]: the weight's K tile `tile`; [i, j, n] is row 8 * i + j."""
    packed_rows = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4  # row 8 * i + j's value sits in packed row i at bits 4 * j
    packed_offs = (tile * (BLOCK_K // 8) + packed_rows)[:, None].to(tl.int64) * N + offs_n[None, :]
    packed = tl.load(qweight_ptr + packed_offs, mask=mask_n[None, :])  # [BLOCK_K / 8, BLOCK_N]
    group_row = (tile * BLOCK_K // GROUP) * N  # < K / 32 * N: int32 suffices
    scale = tl.load(scales_ptr + group_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if DEQUANT == "nf4" or DEQUANT == "fp4":
        return lookup_levels(packed, DEQUANT) * scale[None, None, :]
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    if DEQUANT == "table":
        return tl.load(codebook_ptr + nibbles) * scale[None, None, :]
    zero = tl.load(zeros_ptr + group_row + offs_n, mask=mask_n, other=0.0).to(tl.float32) + MAGIC_VALUE
    return ((nibbles | MAGIC).to(tl.float32, bitcast=True) - zero[None, None, :]) * scale[None, None, :]


@triton.jit
def _store_tile(acc, y_ptr, partials_ptr, arrivals_ptr, offs_m, offs_n, M, N, arrival_index, pid_k,
                SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Writes a program's float32 [BLOCK_M, BLOCK_N] sum to y, or (split-K) to the workspace, the last
    of the tile's SPLIT_K programs to arrive adding the partials in split order into y."""
    tile_offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + tile_offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partials_ptr + pid_k.to(tl.int64) * M * N + tile_offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrival = arrivals_ptr + arrival_index
        if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:  # the last to arrive sums
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(SPLIT_K):  # in split order: the same sum whichever arrived last
                part = partials_ptr + split * M * N + tile_offsets
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")  # from L2, not a stale L1
            tl.store(y_ptr + tile_offsets, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrival, 0)  # ready for the next launch (graph replays included)


@triton.jit
def _int4_gemv_kernel(
    y_ptr,  # [1, N] in x's dtype, contiguous
    partials_ptr,  # float32 [SPLIT_K, 1, N] (SPLIT_K > 1), contiguous
    arrivals_ptr,  # int32 [>= N tiles], zero between launches (SPLIT_K > 1)
    x_ptr,  # [1, K]
    qweight_ptr,  # int32 [K / 8, N], contiguous
    scales_ptr,  # [K / G, N] float16 (affine) or float32 (codebook), contiguous
    zeros_ptr,  # float16 [K / G, N], contiguous (affine; not read with a codebook)
    codebook_ptr,  # float32 [16] (codebook; not read when affine)
    M,  # 1
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DEQUANT: tl.constexpr,  # "affine", "table" (the codebook read from memory), "nf4" or "fp4" (in registers)
):
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_tiles = K // BLOCK_K
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, k_tiles)
    x_cols = tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BLOCK_K / 8, 8]: 8 * i + j
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(first, last):
        w = _dequantize_tile(qweight_ptr, scales_ptr, zeros_ptr, codebook_ptr, tile, offs_n, mask_n, N, GROUP, BLOCK_K,
                             DEQUANT)  # fmt: skip
        x = tl.load(x_ptr + tile * BLOCK_K + x_cols).to(tl.float32)
        acc += tl.sum(tl.sum(x[:, :, None] * w, axis=1), axis=0)
    rows = tl.arange(0, BLOCK_M)
    _store_tile(acc[None, :], y_ptr, partials_ptr, arrivals_ptr, rows, offs_n, M, N, pid_n, pid_k, SPLIT_K, BLOCK_M,
                BLOCK_N)  # fmt: skip


@triton.jit
def _int4_gemm_kernel(
    y_ptr,  # [M, N] in x's dtype, contiguous
    partials_ptr,  # float32 [SPLIT_K, M, N] (SPLIT_K > 1), contiguous
    arrivals_ptr,  # int32 [>= grid tiles], zero between launches (SPLIT_K > 1)
    x_ptr,  # [M, K], last axis contiguous
    qweight_ptr,  # int32 [K / 8, N], contiguous
    scales_ptr,  # [K / G, N] float16 (affine) or float32 (codebook), contiguous
    zeros_ptr,  # float16 [K / G, N], contiguous (affine; not read with a codebook)
    codebook_ptr,  # float32 [16] (codebook; not read when affine)
    M,
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DEQUANT: tl.constexpr,  # "affine", "table" (the codebook read from memory), "nf4" or "fp4" (in registers)
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(first, last):
        offs_k = tile * BLOCK_K + rows
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        # each int32 loaded once and spread over its eight rows in registers (a load of
        # offs_k // 8 would stage every int32 eight times in shared memory)
        w = _dequantize_tile(qweight_ptr, scales_ptr, zeros_ptr, codebook_ptr, tile, offs_n, mask_n, N, GROUP, BLOCK_K,
                             DEQUANT)  # fmt: skip
        w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x.dtype)  # row 8 * i + j: packed row i, nibble j
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    arrival_index = pid_m * tl.num_programs(1) + pid_n
    _store_tile(acc, y_ptr, partials_ptr, arrivals_ptr, offs_m, offs_n, M, N, arrival_index, pid_k, SPLIT_K,
                BLOCK_M, BLOCK_N)  # fmt: skip


def int4_gemm(x: torch.Tensor, weight: Int4Weight, config: Int4Config | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] (float16, bfloat16 or float32; last axis contiguous) times the
    4-bit weight [N, K] transposed; `config` None: int4_config's for the shapes and this GPU."""
    m, k = x.shape
    n, weight_k = weight.shape
    if k != weight_k:
        raise ValueError(f"x [M, K={k}] does not match the weight's K={weight_k}")
    if x.stride(1) != 1:
        raise ValueError("x's last axis must be contiguous")
    codebook = weight.codebook is not None
    # the dequantization's second operand: zero points [K/G, N], or the codebook [16]
    second = weight.codebook if codebook else weight.zeros
    for name, tensor in (("qweight", weight.qweight), ("scales", weight.scales), ("zeros or codebook", second)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if weight.scales.shape[1] != n or (not codebook and weight.scales.shape != second.shape):
        raise ValueError(f"scales {tuple(weight.scales.shape)} and zeros must be [K/G, N={n}]")
    if codebook and (second.shape != (16,) or second.dtype != torch.float32 or weight.scales.dtype != torch.float32):
        raise ValueError("a codebook weight has a float32 codebook [16] and float32 scales")
    group = weight.group_size
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if config is None:
        config = int4_config(m, n, k, group, _sm_count(x.device))
    if group % config.block_k or config.block_k % PACK:
        raise ValueError(f"BLOCK_K={config.block_k} must divide the group size {group} and be a multiple of {PACK}")
    if config.gemv and (m != 1 or config.block_m != 1):
        raise ValueError(f"the CUDA-core kernel multiplies one row (BLOCK_M 1), not {m} (BLOCK_M {config.block_m})")
    split = config.split_k
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partials, arrivals = y, y  # never read without a split
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        arrivals = weight.arrivals
        if grid[0] * grid[1] > arrivals.numel():
            raise ValueError(f"a split-K launch of {grid[0] * grid[1]} tiles exceeds the {arrivals.numel()} counters")
    # the operand a launch does not read is given the scales' pointer: the kernels take both
    zeros, table = (weight.scales, second) if codebook else (second, weight.scales)
    operands = (y, partials, arrivals, x, weight.qweight, weight.scales, zeros, table, m, n, k, x.stride(0))
    tiles = {"GROUP": group, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
             "SPLIT_K": split, "DEQUANT": dequantization(weight), "num_warps": config.num_warps,
             "num_stages": config.num_stages}  # fmt: skip
    if config.gemv:
        _int4_gemv_kernel[grid](*operands, **tiles)
    else:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 models get float32 products
        _int4_gemm_kernel[grid](*operands, **tiles, DOT_PRECISION=precision)
    return y


def dequantization(weight: Int4Weight) -> str:
    """The kernels' DEQUANT for `weight`: "affine"; a named codebook's (NF4, FP4) in registers on the
    GPU; any other codebook, and every codebook under the interpreter (which runs no inline
    assembly), "table": read from memory."""
    if weight.codebook is None:
        return "affine"
    if weight.codebook_name is None or os.environ.get("TRITON_INTERPRET") == "1":
        return "table"
    return weight.codebook_name


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# decode launches aim for this many programs per SM: a memory-bound kernel needs several in flight
# per SM to keep its loads queued
_PROGRAMS_PER_SM = 2


def int4_config(m: int, n: int, k: int, group: int, sm_count: int) -> Int4Config:
    """The launch for y [m, n] = x [m, k] · W [n, k]ᵀ, reasoned from Llama-3-8B's shapes on H100/H200
    (132 SMs): qkv 6144×4096, o 4096×4096, gate_up 28672×4096, down 4096×14336.

    One row (decode of one sequence) takes the CUDA-core kernel (_gemv_config). More, up to 64
    (decode), are bound by the weight's bytes: BLOCK_M covers the batch in one row of tiles
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
    if m == 1:
        return _gemv_config(n, k, group, sm_count)
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


def _gemv_config(n: int, k: int, group: int, sm_count: int) -> Int4Config:
    """The CUDA-core launch for one row: BLOCK_N 128 and BLOCK_K 128 (one group), the K range split
    in powers of two until the GPU holds two programs per SM, each split keeping two K tiles or more
    (within 2% of the best of a grid of tiles, warps, stages and splits on an H100:
    `python -m bench.int4_gemm --sweep`)."""
    block_n, block_k = 128, min(128, group)
    tiles = triton.cdiv(n, block_n)
    k_tiles = k // block_k
    split = 1
    while tiles * split < _PROGRAMS_PER_SM * sm_count and split * 2 * 2 <= k_tiles and split < 16:
        split *= 2
    return Int4Config(1, block_n, block_k, split, num_warps=4, num_stages=3, gemv=True)
