"""Shrink and expand of a decode-sized batch in one launch, for the side stream beside a short base GEMM.

Semantics (reference.py; A_i[s], B_i[s] read through the page table, see tiles.py):
    for each token t with s = token_slots[t] >= 0 and r = slot_ranks[s] > 0, for each slice i:
        delta = slot_scales[s] * (x[t] @ A_i[s, :r].T) @ B_i[s, :, :r].T
        accumulate: y[t, cols_i] += delta;   otherwise: y[t, cols_i] = delta (0 for rows without LoRA)

Why one launch: beside the short decode GEMMs of a quantized base (a 4-bit weight's tinygemm,
kernels/quant/int4_mma.py; an fp8 weight's W8A16) the shrink → expand chain on the side stream, two
dependent launches, became the critical path of the layer (docs/benchmarks.md, "single launch").
Here both phases are one grid of S + E programs:

    ticket   each program first takes a ticket (an atomic counter): the first S to start shrink,
             the next E expand. Roles follow the order programs start in, not their ids, so a
             waiting program waits only for programs that are already running: the wait ends
             whatever the GPU's other work or the grid's size (a barrier over program ids could
             wait forever for programs with no SM to start on)
    shrink   shrink ticket s takes K chunks s, s + S, ...: for every token of the batch, its partial
             x · Aᵀ over the chunk, all slices, added (atomically, fp32) into the workspace z, then
             counts itself done
    expand   expand ticket e waits until all S are done, then takes output tiles e, e + E, ... of all
             slices: for every token, its scaled z · Bᵀ over the tile, added into (or written to) y
    reset    the last expand program to finish zeroes z and the counters for the next launch

Tokens are not grouped by adapter: each gathers its own A and B rows through its sorted position's
page table row (as expand_gather.py does), so the kernel is for the few tokens of decode steps.

The workspace (z [MAX_TOKENS, MAX_SLICES, R_PAD] fp32 and the counters, zero between launches) is
one per device, thread and R_PAD: launches on one thread's side stream run one after another, and
so do the branches a CUDA graph captures from it (each projection's side work joins before the next
forks), which is what keeps one workspace correct. It is allocated on the first launch, an eager
one (the engine runs every shape eagerly before capturing it). The Triton interpreter runs the
programs one after another in id order, which is ticket order: the same code runs there.
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from kernels.lora.configs import SingleLaunchConfig
from kernels.lora.metadata import LoRABatch
from kernels.lora.tiles import (
    MAX_SLICES,
    SliceGroup,
    b_row_offsets,
    check_batch,
    load_ranked,
    page_ids,
    rank_pad,
    select,
    select_ptr,
    slice_of,
)

# the most tokens a launch takes: every program holds all their rows at once ([T, R_PAD, BLOCK_K]),
# which is right for the few tokens of decode steps (paths.py says when it is used)
MAX_TOKENS = 8
# the workspace's counters: tickets taken, shrink programs done, expand programs done
TICKETS: tl.constexpr = tl.constexpr(0)
SHRUNK: tl.constexpr = tl.constexpr(1)
EXPANDED: tl.constexpr = tl.constexpr(2)
NUM_COUNTERS: tl.constexpr = tl.constexpr(3)


@triton.jit
def _shrink_slice(a_ptr, z_ptrs, z_mask, x, a_offs, a_mask):
    """z[T, R] += x [T, K] · A_i rows [T, R, K] (each token its own adapter's), atomically in fp32."""
    a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0).to(tl.float32)
    tl.atomic_add(z_ptrs, tl.sum(a * x[:, None, :], axis=2), mask=z_mask, sem="relaxed")


@triton.jit(do_not_specialize=["num_tokens", "shrink_programs", "expand_programs"])
def _single_launch_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, z_ptr, counters_ptr,
    sorted_tokens_ptr, sorted_ranks_ptr, sorted_scales_ptr, sorted_pages_ptr,
    num_tokens, shrink_programs, expand_programs, max_rank, k_size,
    n0, n1, n2, col0, col1, col2, tiles0, tiles1, tiles2, x_stride, y_stride, z_stride,
    NUM_SLICES: tl.constexpr, PR: tl.constexpr, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    # the role comes from the order programs start in, not from the program id (module docstring)
    ticket = tl.atomic_add(counters_ptr + TICKETS, 1, sem="relaxed")
    pos = tl.arange(0, BLOCK_T)
    pos_ok = pos < num_tokens
    token = tl.load(sorted_tokens_ptr + pos, mask=pos_ok, other=0).to(tl.int64)
    rank = tl.minimum(tl.load(sorted_ranks_ptr + pos, mask=pos_ok, other=0), max_rank)  # 0: no LoRA
    has_lora = pos_ok & (rank > 0)
    r = tl.arange(0, R_PAD)
    page = page_ids(sorted_pages_ptr, tl.where(pos_ok, pos, 0)[:, None], r[None, :], max_rank, PR)  # [T, R]
    z_ptrs = z_ptr + token[:, None] * z_stride + r[None, :]  # [T, R] of slice 0; slice i is i * R_PAD on
    z_mask = has_lora[:, None] & (r[None, :] < rank[:, None])

    if ticket < shrink_programs:
        k_offs = tl.arange(0, BLOCK_K)
        a_rows = page[:, :, None] * PR * k_size + (r % PR)[None, :, None] * k_size  # [T, R, 1]
        for chunk in range(ticket, tl.cdiv(k_size, BLOCK_K), shrink_programs):
            k = chunk * BLOCK_K + k_offs
            k_ok = k < k_size
            x_mask = has_lora[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + token[:, None] * x_stride + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            a_offs = a_rows + k[None, None, :]
            a_mask = z_mask[:, :, None] & k_ok[None, None, :]
            _shrink_slice(a0_ptr, z_ptrs, z_mask, x, a_offs, a_mask)
            if NUM_SLICES > 1:
                _shrink_slice(a1_ptr, z_ptrs + R_PAD, z_mask, x, a_offs, a_mask)
            if NUM_SLICES > 2:
                _shrink_slice(a2_ptr, z_ptrs + 2 * R_PAD, z_mask, x, a_offs, a_mask)
        tl.debug_barrier()  # every thread's adds are issued before the program counts itself done
        tl.atomic_add(counters_ptr + SHRUNK, 1, sem="release")
    else:
        # every shrink ticket is held by a program that has started, so this wait always ends
        while tl.atomic_add(counters_ptr + SHRUNK, 0, sem="acquire") < shrink_programs:
            pass
        scale = tl.load(sorted_scales_ptr + pos, mask=pos_ok, other=0.0)
        n_offs = tl.arange(0, BLOCK_N)
        for tile in range(ticket - shrink_programs, tiles0 + tiles1 + tiles2, expand_programs):
            slice_id, pid_n = slice_of(tile, tiles0, tiles1)
            width = select(slice_id, n0, n1, n2)
            col = select(slice_id, col0, col1, col2)
            n = pid_n * BLOCK_N + n_offs
            n_ok = n < width
            # .cg: from L2, where the atomics summed z (L1 is not coherent across the SMs)
            z = tl.load(z_ptrs + slice_id * R_PAD, mask=z_mask, other=0.0, cache_modifier=".cg")
            b_ptr = select_ptr(slice_id, b0_ptr, b1_ptr, b2_ptr)
            b_ptrs = b_ptr + b_row_offsets(page, r, n, width, PR)  # [T, N, R]
            b = load_ranked(b_ptrs, r[None, None, :], rank[:, None, None], max_rank, n_ok[None, :, None])
            delta = tl.sum(b.to(tl.float32) * z[:, None, :], axis=2) * scale[:, None]  # [T, N]
            y_ptrs = y_ptr + token[:, None] * y_stride + col + n[None, :]
            if ACCUMULATE:
                y_mask = has_lora[:, None] & n_ok[None, :]
                delta += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            else:
                y_mask = pos_ok[:, None] & n_ok[None, :]
            tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=y_mask)
        # the last expand program out zeroes the workspace: by then every program has taken its
        # ticket, the shrink programs are done and every other expand program has read z
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + EXPANDED, 1, sem="acq_rel") == expand_programs - 1:
            for i in tl.static_range(NUM_SLICES):
                tl.store(z_ptrs + i * R_PAD, tl.zeros((BLOCK_T, R_PAD), tl.float32), mask=z_mask)
            counters = tl.arange(0, 4)
            tl.store(counters_ptr + counters, tl.zeros((4,), tl.int32), mask=counters < NUM_COUNTERS)


@functools.cache
def _workspace(device: torch.device, thread: int, r_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(z float32 [MAX_TOKENS, MAX_SLICES, R_PAD], counters int32 [NUM_COUNTERS]), zero; see the
    module docstring."""
    z = torch.zeros(MAX_TOKENS, MAX_SLICES, r_pad, dtype=torch.float32, device=device)
    return z, torch.zeros(NUM_COUNTERS.value, dtype=torch.int32, device=device)


def lora_single_launch(
    y: torch.Tensor,
    x: torch.Tensor,
    group: SliceGroup,
    batch: LoRABatch,
    config: SingleLaunchConfig,
    accumulate: bool = True,
) -> None:
    """Adds (accumulate) or writes the LoRA delta of x [T, K] into y [T, sum N_i] (this group's slices
    at group.columns), T <= MAX_TOKENS; see the module docstring."""
    num_tokens, k_size = x.shape
    max_rank = check_batch(group, batch, num_tokens)
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"a single launch takes at most {MAX_TOKENS} tokens, got {num_tokens}")
    if y.shape[0] != num_tokens or y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"y {tuple(y.shape)} {y.dtype} must be [T={num_tokens}, ...] in x's dtype, unit column stride")
    if num_tokens == 0:
        return
    r_pad = rank_pad(max_rank)
    z, counters = _workspace(x.device, threading.get_ident(), r_pad)
    tiles = group.tiles(config.block_n)
    shrink_programs = min(triton.cdiv(k_size, config.block_k), config.max_programs)
    expand_programs = min(sum(tiles), config.max_programs)
    _single_launch_kernel[(shrink_programs + expand_programs,)](
        x, *group.lora_a, *group.lora_b, y, z, counters,
        batch.sorted_tokens, batch.sorted_ranks, batch.sorted_scales, batch.sorted_pages,
        num_tokens, shrink_programs, expand_programs, max_rank, k_size,
        *group.widths, *group.columns, *tiles, x.stride(0), y.stride(0), z.stride(0),
        NUM_SLICES=group.num_slices, PR=group.page_rank, R_PAD=r_pad, BLOCK_T=triton.next_power_of_2(num_tokens),
        BLOCK_K=config.block_k, BLOCK_N=config.block_n, ACCUMULATE=accumulate, num_warps=config.num_warps,
    )  # fmt: skip
