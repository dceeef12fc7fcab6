"""Checkpoint tensors into a projection's 4-bit weight, in the one layout the W4A16 GEMM reads
(kernels/quant/int4_reference.py: int32 packed along K, float16 scales and zero points per group).

Each loader fills one slice of a packed layer (its output columns of `qweight` [K / 8, N],
`scales` and `zeros` [K / G, N]) from one checkpoint tensor, on the layer's device:
    plain weight [N_i, K]        quantized at load (asymmetric, round to nearest, per group)
    AWQ  qweight [K, N_i / 8]    unpacked along N in AWQ's interleaved order, repacked along K
         qzeros  [K / G, N_i / 8] unpacked the same way
    GPTQ qweight [K / 8, N_i]    copied as it is: our packing is GPTQ's
         qzeros  [K / G, N_i / 8] unpacked in order; GPTQ stores each zero point minus one
    both scales  [K / G, N_i]    copied as they are
Groups run along K, within one output column, so the packed q/k/v or gate/up slices quantize
exactly as if they were separate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.quant.int4_reference import (
    AWQ_ORDER,
    GPTQ_ZERO_OFFSET,
    PACK,
    Int4Weight,
    pack_along_k,
    pack_along_n,
    quantize_int4,
    unpack_along_n,
)
from worker.model.weights import copy_weight

# GPTQ's zero points in order along N (AWQ interleaves its)
_IN_ORDER = tuple(range(PACK))


def quantize_into(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, tensor: torch.Tensor, *, name: str
) -> None:
    """Quantize the checkpoint's floating-point `tensor` [N_i, K] into a slice's `qweight` [K / 8, N_i],
    `scales` and `zeros` [K / G, N_i] (the group size is the slice's: K over the scales' rows)."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: the checkpoint holds {tensor.dtype} weights but its config.json has no "
                         "quantization_config")  # fmt: skip
    k = qweight.shape[0] * PACK
    staged = _staged(tensor, (qweight.shape[1], k), tensor.dtype, qweight.device, name=name)
    _, packed = quantize_int4(staged, k // scales.shape[0])
    qweight.copy_(packed.qweight)
    scales.copy_(packed.scales)
    zeros.copy_(packed.zeros)


def copy_awq_qweight(qweight: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """An AWQ `qweight` int32 [K, N_i / 8] into the slice's `qweight` [K / 8, N_i], repacked along K."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    levels = unpack_along_n(_staged_int32(tensor, (k, _packed_width(n, name)), qweight.device, name=name), AWQ_ORDER)
    qweight.copy_(pack_along_k(levels))


def copy_gptq_qweight(qweight: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """A GPTQ `qweight` int32 [K / 8, N_i] into the slice's `qweight` as it is."""
    _check_int32(tensor, name)
    copy_weight(qweight, tensor, name=name)


def zeros_loader(method: str) -> Callable[..., None]:
    """The loader of `method`'s ("awq" or "gptq") packed zero points."""
    return copy_awq_zeros if method == "awq" else copy_gptq_zeros


def copy_awq_zeros(zeros: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """AWQ `qzeros` int32 [K / G, N_i / 8] into the slice's float16 `zeros` [K / G, N_i]."""
    _copy_zeros(zeros, tensor, AWQ_ORDER, 0, name=name)


def copy_gptq_zeros(zeros: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """GPTQ `qzeros` int32 [K / G, N_i / 8] (each zero point minus one) into the slice's `zeros`."""
    _copy_zeros(zeros, tensor, _IN_ORDER, GPTQ_ZERO_OFFSET, name=name)


def gptq_tensors(weight: Int4Weight) -> dict[str, torch.Tensor]:
    """What a GPTQ checkpoint (checkpoint_format gptq, desc_act false) holds for the affine 4-bit
    `weight` [N, K], by tensor suffix: `qweight` int32 [K / 8, N], `qzeros` int32 [K / G, N / 8] (each
    zero point minus GPTQ_ZERO_OFFSET), `scales` float16 [K / G, N], `g_idx` int32 [K] (k // G); the
    inverse of the GPTQ loaders above, for `lorafleet quantize`."""
    if weight.zeros is None:
        raise ValueError("a GPTQ checkpoint holds affine 4-bit weights, not codebook ones")
    zeros = weight.zeros.to(torch.int32)
    if not torch.equal(zeros.to(weight.zeros.dtype), weight.zeros) or int(zeros.min()) < GPTQ_ZERO_OFFSET:
        raise ValueError(f"a GPTQ checkpoint holds integer zero points of {GPTQ_ZERO_OFFSET} or more")
    k = weight.shape[1]
    return {
        "qweight": weight.qweight.contiguous(),
        "qzeros": pack_along_n(zeros - GPTQ_ZERO_OFFSET, _IN_ORDER),
        "scales": weight.scales.half().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32, device=weight.qweight.device) // weight.group_size,
    }


def copy_scales(scales: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """A checkpoint's `scales` [K / G, N_i] (float16 as published) into the slice's float16 `scales`."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: scales must be floating point, not {tensor.dtype}")
    copy_weight(scales, tensor, name=name)


def _copy_zeros(zeros: torch.Tensor, tensor: torch.Tensor, order: tuple[int, ...], offset: int, *, name: str) -> None:
    groups, n = zeros.shape
    packed = _staged_int32(tensor, (groups, _packed_width(n, name)), zeros.device, name=name)
    zeros.copy_(unpack_along_n(packed, order) + offset)


def _packed_width(n: int, name: str) -> int:
    if n % PACK:
        raise ValueError(f"{name}: {n} output columns cannot be packed {PACK} to an int32 along N")
    return n // PACK


def _check_int32(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype != torch.int32:
        raise ValueError(f"{name}: packed 4-bit weights must be int32, not {tensor.dtype}")


def _staged_int32(tensor: torch.Tensor, shape: tuple[int, int], device: torch.device, *, name: str) -> torch.Tensor:
    _check_int32(tensor, name)
    return _staged(tensor, shape, torch.int32, device, name=name)


def _staged(
    tensor: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, *, name: str
) -> torch.Tensor:
    """`tensor` (checked to be `shape`) on `device`, for repacking there."""
    staged = torch.empty(shape, dtype=dtype, device=device)
    copy_weight(staged, tensor, name=name)  # paced beside a serving model, like any weight
    return staged
