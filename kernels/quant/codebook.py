"""bitsandbytes' 4-bit codebooks (NF4, FP4) and the quantizer onto them, in plain torch.

A codebook weight is 16 levels in [-1, 1] times a per-block absmax (blocks of B inputs along K, 64 by
default): W[n, k] = codes[q[k, n]] * absmax[k // B, n] (int4_reference.Int4Weight, codebook form).
NF4's levels are the quantiles of a normal distribution (QLoRA): denser near zero, where most of a
trained weight's values lie, than a uniform grid. FP4's are a 1-sign, 2-exponent, 1-mantissa float
(bitsandbytes' own bias), listed in code order, not value order. Both tables are bitsandbytes'
`get_4bit_type` values, divided by their largest magnitude in float32 as it divides them; a
published checkpoint's `quant_map` holds the same 16 floats.
"""

from __future__ import annotations

import torch

from kernels.quant.int4_reference import Int4Weight, arrival_counters, pack_along_k

NF4_CODES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# sign, then exponent and mantissa bits; divided by 12 below, as bitsandbytes divides them
_FP4_RAW = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
# an all-zero block divides by this instead of zero (bitsandbytes' clamp), and quantizes to the zero code
_MIN_ABSMAX = 1e-38


def codebook(quant_type: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of each 4-bit code of `quant_type` ("nf4" or "fp4")."""
    if quant_type == "nf4":
        return torch.tensor(NF4_CODES, dtype=torch.float32, device=device)
    if quant_type == "fp4":
        raw = torch.tensor(_FP4_RAW, dtype=torch.float32, device=device)
        return raw / raw.abs().max()
    raise ValueError(f"no 4-bit codebook {quant_type!r} (known: nf4, fp4)")


def quantize_codebook(weight: torch.Tensor, block: int, quant_type: str) -> tuple[torch.Tensor, Int4Weight]:
    """(4-bit codes int32 [K, N], the packed Int4Weight) of weight [N, K]: each block of `block`
    inputs of an output scaled by its absmax (float32) into [-1, 1], each value given the code of the
    nearest level of `quant_type`'s codebook ("nf4" or "fp4"; the midpoints between sorted levels
    decide, as in bitsandbytes). Runs on the weight's device."""
    n, k = weight.shape
    if k % block:
        raise ValueError(f"K={k} must be a multiple of the block size {block}")
    blocks = weight.float().reshape(n, k // block, block)
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    scaled = (blocks * (1.0 / absmax.clamp(min=_MIN_ABSMAX))).clamp(-1.0, 1.0)
    codes = codebook(quant_type, weight.device)
    order = torch.argsort(codes)  # FP4 lists its levels in code order
    midpoints = (codes[order[:-1]] + codes[order[1:]]) / 2
    q = order[torch.bucketize(scaled, midpoints)].to(torch.int32).reshape(n, k)
    layout = Int4Weight(
        qweight=pack_along_k(q.T),
        scales=absmax.reshape(n, -1).T.contiguous(),
        zeros=None,
        arrivals=arrival_counters(weight.device),
        codebook=codes,
        codebook_name=quant_type,
    )
    return q.T.contiguous(), layout
