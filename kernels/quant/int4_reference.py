"""4-bit group-wise weights with 16-bit activations (W4A16) in plain torch: the one packed layout every
source format is repacked into, the quantizer used at load, and the semantics the Triton GEMM
(int4_gemm.py) reproduces; also the path taken off CUDA.

Layout (`Int4Weight`), for a projection weight W [N, K] (N outputs, K inputs) in groups of G inputs:
    qweight  int32 [K / 8, N]    eight 4-bit values along K per int32: q[k, n] is bits 4 * (k % 8)
                                 of qweight[k // 8, n] (GPTQ's own packing, so a GPTQ weight is
                                 copied as it is; AWQ's, packed along N, is repacked)
    scales   [K / G, N]          one scale per group and output channel
and one of two ways to turn a 4-bit value into a weight:
    affine    zeros float16 [K / G, N], scales float16: W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
    codebook  codebook float32 [16], scales float32:    W[n, k] = codebook[q[k, n]] * scales[k // G, n]
each computed in float32. Affine is int4 / AWQ / GPTQ; codebook is bitsandbytes' NF4 and FP4
(codebook.py), whose 16 levels are not evenly spaced (no zero point and step can stand for them) and
whose per-block absmax is float32 as published, so it is kept exact.

The zero points are held as floats (not packed nibbles) so that asymmetric (AWQ, GPTQ, ours) and
symmetric (GPTQ sym: 8) weights take one kernel, and GPTQ's stored-minus-one zero points (16 for a
symmetric 4-bit group that stored 15) fit; they cost 2 bytes per group of 128, 3% of the 4-bit bytes.

int4_linear:  y = x @ W.T (+ bias), W dequantized in float32 then rounded to x's dtype, products
              accumulated in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACK = 8  # 4-bit values per int32
MAX_LEVEL = 15  # the largest 4-bit value
# the smallest scale: an all-zero group quantizes to its zero point instead of dividing by zero;
# float16's smallest normal, so the stored scale keeps full precision
MIN_SCALE = 2.0**-14
# AWQ's GEMM packing along N: nibble i of an int32 holds column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# GPTQ checkpoints ("checkpoint_format" gptq) store each zero point minus this in a nibble, and their
# readers add it back: a zero point of 0 cannot be written (it would read back as 16)
GPTQ_ZERO_OFFSET = 1
# the fixed codebooks (codebook.py) the GPU kernel holds in registers (codebook_lookup.py)
CODEBOOK_NAMES = ("nf4", "fp4")


# inputs per word group of the tensor cores' layout (int4_mma.py): K is a multiple of this there
MMA_K_ALIGN = 128
# split-K arrival counters a weight keeps for its GEMM (int4_gemm.py): more than the tiles of any
# split launch (int4_config splits only launches of fewer tiles than two per SM)
ARRIVAL_COUNTERS = 1024


@dataclass(frozen=True, slots=True)
class MmaInt4Weight:
    """A projection's affine 4-bit weight in the tensor cores' layout (int4_mma.py says how it is
    packed and why a weight keeps one beside its k-major form)."""

    qweight: torch.Tensor  # int32 [N / 8, K / 128, 32, 4]
    scale_offsets: torch.Tensor  # bfloat16 [K / G, N, 2]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): the shape of the weight it stands for."""
        return self.scale_offsets.shape[1], self.qweight.shape[1] * MMA_K_ALIGN

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale_offsets.shape[0]


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A projection's 4-bit weight in the layout above (tensors on one device), affine (`zeros`) or
    codebook (`codebook`), with the counters its split-K GEMM synchronises on. They belong to the
    weight, not to the device: a weight is multiplied by one step at a time (its model's), while two
    models' steps, or one model's graph capture beside another's serving, may run at once on two
    streams."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # [K / G, N]: float16 (affine) or float32 (codebook)
    zeros: torch.Tensor | None  # float16 [K / G, N] (affine), None (codebook)
    arrivals: torch.Tensor  # int32 [ARRIVAL_COUNTERS], zero between launches
    codebook: torch.Tensor | None = None  # float32 [16]: the value of each 4-bit code (codebook), else None
    # which of CODEBOOK_NAMES `codebook` holds (the GPU kernel then looks levels up in registers), or
    # None: any other 16 levels, read from `codebook`
    codebook_name: str | None = None
    # the same affine weight in the tensor cores' layout, for steps of few rows (int4_mma.py), or None
    tensor_cores: MmaInt4Weight | None = None

    def __post_init__(self) -> None:
        if (self.zeros is None) == (self.codebook is None):
            raise ValueError("a 4-bit weight has zero points (affine) or a codebook, exactly one of them")
        if self.codebook_name is not None and (self.codebook is None or self.codebook_name not in CODEBOOK_NAMES):
            raise ValueError(f"codebook_name {self.codebook_name!r} names none of {CODEBOOK_NAMES} or has no codebook")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): the shape of the weight it stands for."""
        return self.qweight.shape[1], self.qweight.shape[0] * PACK

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[0]


def arrival_counters(device: torch.device | str) -> torch.Tensor:
    """A weight's split-K arrival counters: int32 [ARRIVAL_COUNTERS] zeros on `device`."""
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def pack_along_k(q: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] for 4-bit values q [K, N] (any integer dtype, values 0..15)."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"K={k} must be a multiple of {PACK} to pack 4-bit values along it")
    nibbles = q.to(torch.int32).reshape(k // PACK, PACK, n)
    packed = torch.zeros(k // PACK, n, dtype=torch.int32, device=q.device)
    for i in range(PACK):
        packed |= nibbles[:, i] << (4 * i)  # nibble 7's shift wraps into the sign bit, as int32 does
    return packed


def unpack_along_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K, N] 4-bit values (0..15) of qweight int32 [K / 8, N]."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=qweight.device)
    nibbles = (qweight.unsqueeze(1) >> shifts.view(1, PACK, 1)) & MAX_LEVEL  # [K / 8, 8, N]
    return nibbles.reshape(-1, qweight.shape[1])


def unpack_along_n(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C * 8] 4-bit values of `packed` int32 [R, C], whose nibble i of column c holds column
    c * 8 + order[i] (AWQ: AWQ_ORDER; GPTQ's zero points: in order)."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & MAX_LEVEL  # [R, C, 8]: nibble i
    columns = torch.empty_like(nibbles)
    columns[..., list(order)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def pack_along_n(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The inverse of unpack_along_n: int32 [R, C] for 4-bit values q [R, C * 8]."""
    r, c = q.shape
    columns = q.to(torch.int32).reshape(r, c // PACK, PACK)
    packed = torch.zeros(r, c // PACK, dtype=torch.int32, device=q.device)
    for i, column in enumerate(order):
        packed |= columns[..., column] << (4 * i)
    return packed


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, Int4Weight]:
    """(4-bit values int32 [K, N], the packed Int4Weight) of weight [N, K], round to nearest,
    asymmetric per group of `group_size` inputs: scale = (max - min) / 15 (rounded to float16 first,
    so the values are rounded against the scale that is stored), zero point = round(-min / scale),
    q = clamp(round(w / scale) + zero, 0, 15). Asymmetric because a group's weights are rarely
    centred on zero; it spends all 16 levels on [min, max]. Runs on the weight's device."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of the group size {group_size}")
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales, zeros = affine_grid(groups)
    q = round_to_grid(groups, scales, zeros).reshape(n, k)
    return q.T.contiguous(), affine_int4(q, scales.reshape(n, -1), zeros.reshape(n, -1))


def affine_int4(levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Weight:
    """The packed Int4Weight of 4-bit `levels` [N, K] on the grids `scales` and `zeros` [N, K / G]."""
    return Int4Weight(
        qweight=pack_along_k(levels.T),
        scales=scales.T.half().contiguous(),
        zeros=zeros.T.half().contiguous(),
        arrivals=arrival_counters(levels.device),
    )


def affine_grid(groups: torch.Tensor, *, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zero points), float32 [..., 1] each, of the 4-bit grids for `groups` [..., G]: the 16
    levels (q - zero) * scale span [min, max] of each group, 0 included (zero weights stay exact);
    the scale is rounded to float16 first, so values are rounded against the scale that is stored.
    `min_zero`: the smallest zero point the grid may have; a group with less than half a step below
    zero then takes levels from -min_zero * scale up to its max (GPTQ's checkpoints need 1)."""
    low = groups.amin(dim=-1, keepdim=True).clamp(max=0.0)
    high = groups.amax(dim=-1, keepdim=True).clamp(min=0.0)
    scales = ((high - low) / MAX_LEVEL).clamp(min=MIN_SCALE).half().float()
    zeros = torch.round(-low / scales).clamp(0, MAX_LEVEL)
    if min_zero:
        short = zeros < min_zero
        above = (high / (MAX_LEVEL - min_zero)).clamp(min=MIN_SCALE).half().float()
        scales, zeros = torch.where(short, above, scales), zeros.clamp(min=min_zero)
    return scales, zeros


def round_to_grid(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """int32 4-bit levels of `values` on the grids (scales, zeros) broadcast over them: round to nearest."""
    return (torch.round(values / scales) + zeros).clamp(0, MAX_LEVEL).to(torch.int32)


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """float32 [N, K]: the weight `weight` stands for."""
    q = unpack_along_k(weight.qweight)  # [K, N]
    group = weight.group_size
    scales = weight.scales.float().repeat_interleave(group, dim=0)
    if weight.codebook is not None:
        return (weight.codebook.float()[q.long()] * scales).T
    zeros = weight.zeros.float().repeat_interleave(group, dim=0)
    return ((q.float() - zeros) * scales).T


def int4_linear_reference(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] → [T, N] in x's dtype: x @ W.T (+ bias [N]), W dequantized then rounded to x's dtype
    (the dtype the kernel feeds the tensor cores), accumulated in float32."""
    return linear_on_dequantized(x, dequantize_int4(weight), bias)


def linear_on_dequantized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] → [T, N] in x's dtype: x @ weight.T (+ bias [N]) for a dequantized float32 weight
    [N, K], rounded to x's dtype first (the dtype the kernels feed the tensor cores), accumulated in float32."""
    w = weight.to(x.dtype)
    y = x.float() @ w.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
