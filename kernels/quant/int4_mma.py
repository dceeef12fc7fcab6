"""Affine 4-bit weights in the tensor cores' operand layout: the layout torch's int4 GEMM reads
(`torch._weight_int4pack_mm`, the "tinygemm" kernel of gpt-fast and torchao), a second copy a bf16
model's affine 4-bit projections keep on CUDA for steps of at most TINYGEMM_MAX_TOKENS rows.

Why a copy: at one to a few rows tinygemm multiplies on the tensor cores straight from registers,
its weight words already in the MMA's fragment order, and reads the 4-bit weights at 0.4-0.6 of the
H100's copy bandwidth, 1.4-2x faster than our Triton kernels on the k-major layout
(int4_reference.py); from about 8 rows on it pads every row block to 16 and falls far behind them
(at 64 rows 4x slower). Our Triton kernels on this layout measured 1.7x slower than on the k-major
one even with x permuted beforehand (docs/benchmarks.md, "tinygemm"): its words spread each
tensor-core tile's inputs in a way a Triton tile cannot load whole. So the k-major weight serves
every step of more rows (and every prefill), and this copy costs half a byte a weight more
(EngineConfig.int4_decode_copy turns it off when memory is worth more than decode of few sequences).

Layout (`MmaInt4Weight`, plain data in int4_reference.py), for W [N, K] in groups of G inputs:
    qweight        int32 [N / 8, K / 128, 32, 4]  word [nt, ko, t, j] holds the eight values of output
                   n = 8 * nt + t // 4 at inputs k(p, i) below, nibble i at bits 4 * i, where
                   p = 16 * ko + 4 * j + t % 4 numbers the words of a column along K (K / 8 of them):
                       k(p, i) = 32 * (p // 4) + 2 * (p % 4) + 8 * (i % 4) + i // 4
                   so the four words p = 4c..4c+3 of a column cover inputs [32c, 32c + 32), one group's
    scale_offsets  bfloat16 [K / G, N, 2]         (scale, offset) per group and output:
                   W[n, k] = (q - 8) * scale + offset
An affine weight (q - zero) * scale becomes offset = (8 - zero) * scale; scale and offset are rounded
to bfloat16 (tinygemm's dtype), which moves a weight by at most 2**-8 of |q - 8| * scale + |offset|:
the size of the rounding of the dequantized weight to bf16 that the k-major kernels already do.
"""

from __future__ import annotations

import torch

from kernels.quant.int4_reference import MAX_LEVEL, MMA_K_ALIGN, PACK, Int4Weight, MmaInt4Weight, unpack_along_k

INNER_K_TILES = MMA_K_ALIGN // 16  # k-tiles of 16 inputs per word group: four int32 per lane, one 16-byte load
N_ALIGN = 8  # N is a multiple of this (the MMA's n-tile)
GROUP_SIZES = (32, 64, 128, 256)  # the groups tinygemm takes
MID_LEVEL = 8  # tinygemm's implicit zero point
# rows up to which tinygemm is faster than the Triton kernels on the k-major layout (H100; docs/benchmarks.md)
TINYGEMM_MAX_TOKENS = 6


def mma_layout_fits(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether a weight [n, k] in groups of `group_size`, multiplied in `dtype`, can take this layout."""
    return dtype == torch.bfloat16 and n % N_ALIGN == 0 and k % MMA_K_ALIGN == 0 and group_size in GROUP_SIZES


# how the 4-bit values [N, K] fold into the words: n = (nt, nn), k = (ko, j, a, r, b) with
# k = 128 ko + 32 j + 8 a + 2 r + b; word [nt, ko, t = 4 nn + r, j], nibble i = 4 b + a
_VALUES = ("nt", "nn", "ko", "j", "a", "r", "b")
_WORDS = ("nt", "ko", "nn", "r", "j", "b", "a")
_TO_WORDS = tuple(_VALUES.index(axis) for axis in _WORDS)
_TO_VALUES = tuple(_WORDS.index(axis) for axis in _VALUES)


def pack_mma(q: torch.Tensor) -> torch.Tensor:
    """int32 [N / 8, K / 128, 32, 4] words of the 4-bit values q [N, K] (any integer dtype, 0..15)."""
    n, k = q.shape
    if n % N_ALIGN or k % MMA_K_ALIGN:
        raise ValueError(
            f"a weight [{n}, {k}] takes the MMA layout only with N % {N_ALIGN} == 0, K % {MMA_K_ALIGN} == 0"
        )
    values = q.to(torch.int32).reshape(n // 8, 8, k // MMA_K_ALIGN, 4, 4, 4, 2).permute(_TO_WORDS)
    nibbles = values.reshape(n // 8, k // MMA_K_ALIGN, 32, 4, PACK)
    words = torch.zeros(nibbles.shape[:-1], dtype=torch.int32, device=q.device)
    for i in range(PACK):
        words |= nibbles[..., i] << (4 * i)  # nibble 7's shift wraps into the sign bit, as int32 does
    return words


def unpack_mma(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K] 4-bit values of the words qweight int32 [N / 8, K / 128, 32, 4] (pack_mma's inverse)."""
    tiles, k_tiles = qweight.shape[:2]
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=qweight.device)
    nibbles = (qweight.unsqueeze(-1) >> shifts) & MAX_LEVEL  # [N / 8, K / 128, 32, 4, 8]
    values = nibbles.reshape(tiles, k_tiles, 8, 4, 4, 2, 4).permute(_TO_VALUES)
    return values.reshape(tiles * 8, k_tiles * MMA_K_ALIGN)


def to_mma_layout(weight: Int4Weight, *, columns: int = 4096) -> MmaInt4Weight:
    """The affine `weight` in this layout, in new tensors on its device (fill_mma_layout's)."""
    n, k = weight.shape
    device = weight.qweight.device
    out = MmaInt4Weight(
        torch.empty(n // 8, k // MMA_K_ALIGN, 32, 4, dtype=torch.int32, device=device),
        torch.empty(k // weight.group_size, n, 2, dtype=torch.bfloat16, device=device),
    )
    fill_mma_layout(weight, out, columns=columns)
    return out


def fill_mma_layout(weight: Int4Weight, out: MmaInt4Weight, *, columns: int = 4096) -> None:
    """Write the affine `weight` in this layout into `out` (same device, this layout's shapes),
    `columns` outputs at a time so that the unpacked values (4 bytes each) stay a few tens of MiB
    beside a model's weights and no second copy of the whole layer is held at load."""
    if weight.zeros is None:
        raise ValueError("only an affine 4-bit weight (zero points, no codebook) takes the MMA layout")
    n = weight.shape[0]
    for start in range(0, n, columns):
        stop = min(start + columns, n)
        out.qweight[start // 8 : stop // 8] = pack_mma(unpack_along_k(weight.qweight[:, start:stop]).T)
        scales = weight.scales[:, start:stop].float()
        out.scale_offsets[:, start:stop, 0] = scales
        out.scale_offsets[:, start:stop, 1] = (MID_LEVEL - weight.zeros[:, start:stop].float()) * scales


def dequantize_mma(weight: MmaInt4Weight) -> torch.Tensor:
    """float32 [N, K]: the weight `weight` stands for."""
    group = weight.group_size
    scales, offsets = weight.scale_offsets.float().repeat_interleave(group, dim=0).unbind(dim=2)  # [K, N] each
    return ((unpack_mma(weight.qweight).T.float() - MID_LEVEL) * scales + offsets).T


def tinygemm_linear(x: torch.Tensor, weight: MmaInt4Weight) -> torch.Tensor:
    """x bfloat16 [M, K] (CUDA) → [M, N]: torch's tinygemm int4 GEMM on this layout."""
    return torch._weight_int4pack_mm(x.contiguous(), weight.qweight, weight.group_size, weight.scale_offsets)
