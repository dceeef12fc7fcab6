"""bitsandbytes 4-bit checkpoint tensors (shared/bnb_quantization.py) into a projection's codebook
weight, in the layout the W4A16 GEMM reads (kernels/quant/int4_reference.py: codes packed along K,
float32 scales per block), and plain weights quantized onto NF4 at load.

A projection's tensors arrive one by one, in the checkpoint's order; its `BnbSlice` writes what
each gives alone into the slice (its output columns of a packed layer) on the layer's device:
    weight       uint8 [N_i*K/2, 1]  unpacked (the first code of a byte in its high nibble) to
                                     codes [N_i, K], packed along K into qweight [K/8, N_i]
    absmax       float32 [N_i*K/B]   one per block of B inputs of an output: scales [K/B, N_i]
    quant_map    float32 [16]        checked to be the layer's codebook: bitsandbytes' kernels
                                     dequantize with their own table, and so does the GEMM
    quant_state  the JSON (checked at start: shared/bnb_tensors.py)
With double quantization the absmax is 8-bit codes; the slice keeps them, the `nested_absmax`
[cdiv(N_i*K/B, nested_blocksize)], `nested_quant_map` [256] and the quant state's offset until all
have arrived, then writes absmax = nested_quant_map[code] * nested_absmax[block // nested_blocksize]
+ nested_offset in float32, as bitsandbytes' dequantize_blockwise computes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from kernels.quant.codebook import codebook, quantize_codebook
from kernels.quant.int4_reference import PACK, pack_along_k
from worker.model.weights import copy_weight

# bitsandbytes' QuantState.from_dict compares quant maps to this tolerance
_QUANT_MAP_TOLERANCE = 1e-6
# the parts double quantization needs before the absmax can be written
_NESTED_PARTS = ("absmax", "nested_absmax", "nested_quant_map", "quant_state")


def quantize_into(
    qweight: torch.Tensor, scales: torch.Tensor, quant_type: str, tensor: torch.Tensor, *, name: str
) -> None:
    """Quantize the checkpoint's floating-point `tensor` [N_i, K] onto `quant_type`'s codebook into a
    slice's `qweight` [K / 8, N_i] and float32 `scales` [K / B, N_i] (B: K over the scales' rows)."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: the checkpoint holds {tensor.dtype} weights but its config.json has no "
                         "quantization_config")  # fmt: skip
    k = qweight.shape[0] * PACK
    staged = _staged(tensor, (qweight.shape[1], k), tensor.dtype, qweight.device, name=name)
    _, packed = quantize_codebook(staged, k // scales.shape[0], quant_type)
    qweight.copy_(packed.qweight)
    scales.copy_(packed.scales)


class BnbSlice:
    """The loaders of one projection's bitsandbytes tensors, writing the slice `qweight` [K/8, N_i] and
    `scales` float32 [K/B, N_i] of a layer whose codebook is `quant_type`'s ("nf4" or "fp4")."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, *, quant_type: str, nested: bool) -> None:
        self.qweight, self.scales = qweight, scales
        self.quant_type = quant_type
        self.nested = nested
        self._parts: dict[str, object] = {}  # double quantization's parts, until all have arrived

    def loaders(self, key: str) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint tensor name → loader, for the projection saved under `key` (`….q_proj`)."""
        weight = f"{key}.weight"
        loaders = {
            weight: lambda tensor: self._weight(tensor, name=weight),
            f"{weight}.absmax": lambda tensor: self._absmax(tensor, name=f"{weight}.absmax"),
            f"{weight}.quant_map": lambda tensor: self._quant_map(tensor, name=f"{weight}.quant_map"),
            f"{weight}.quant_state.bitsandbytes__{self.quant_type}": self._quant_state,
        }
        if self.nested:
            for part in ("nested_absmax", "nested_quant_map"):
                loaders[f"{weight}.{part}"] = lambda tensor, part=part: self._nested_part(
                    part, _float32(tensor, name=f"{weight}.{part}")
                )
        return loaders

    def _weight(self, tensor: torch.Tensor, *, name: str) -> None:
        k, n = self.qweight.shape[0] * PACK, self.qweight.shape[1]
        packed = _staged(_uint8(tensor, name=name), (n * k // 2, 1), torch.uint8, self.qweight.device, name=name)
        # bitsandbytes packs the row-major [N, K] codes two a byte, the even one in the high nibble
        codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(n, k)
        self.qweight.copy_(pack_along_k(codes.T))

    def _absmax(self, tensor: torch.Tensor, *, name: str) -> None:
        blocks, n = self.scales.shape
        if self.nested:
            staged = _staged(_uint8(tensor, name=name), (n * blocks,), torch.uint8, self.scales.device, name=name)
            self._nested_part("absmax", staged)
            return
        absmax = _staged(_float32(tensor, name=name), (n * blocks,), torch.float32, self.scales.device, name=name)
        self.scales.copy_(absmax.view(n, blocks).T)

    def _quant_map(self, tensor: torch.Tensor, *, name: str) -> None:
        saved = _float32(tensor, name=name).cpu()
        table = codebook(self.quant_type)  # the layer's, on the host: no wait on the device
        if saved.shape != (16,) or not torch.allclose(saved, table, rtol=0, atol=_QUANT_MAP_TOLERANCE):
            raise ValueError(f"{name} is not bitsandbytes' {self.quant_type} table")

    def _quant_state(self, tensor: torch.Tensor) -> None:
        if self.nested:
            self._nested_part("quant_state", json.loads(bytes(tensor.cpu().numpy()).decode("utf-8")))

    def _nested_part(self, part: str, value: object) -> None:
        self._parts[part] = value
        if len(self._parts) < len(_NESTED_PARTS):
            return
        codes, scales, table, state = (self._parts[part] for part in _NESTED_PARTS)
        blocks = codes.shape[0]
        device = self.scales.device
        block_scales = scales.to(device).repeat_interleave(state["nested_blocksize"])[:blocks]
        offset = torch.tensor(float(state["nested_offset"]), dtype=torch.float32, device=device)
        absmax = table.to(device)[codes.long()] * block_scales + offset
        n = self.scales.shape[1]
        self.scales.copy_(absmax.view(n, -1).T)
        self._parts.clear()


def _uint8(tensor: torch.Tensor, *, name: str) -> torch.Tensor:
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{name}: bitsandbytes stores this tensor as uint8, not {tensor.dtype}")
    return tensor


def _float32(tensor: torch.Tensor, *, name: str) -> torch.Tensor:
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name}: bitsandbytes stores this tensor as float32, not {tensor.dtype}")
    return tensor


def _staged(
    tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, name: str
) -> torch.Tensor:
    """`tensor` (checked to be `shape`) on `device`, for unpacking there."""
    staged = torch.empty(shape, dtype=dtype, device=device)
    copy_weight(staged, tensor, name=name)  # paced beside a serving model, like any weight
    return staged
