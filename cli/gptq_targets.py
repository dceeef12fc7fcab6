"""What `lorafleet quantize` rounds the projections onto, and how its checkpoint holds them:
    int4  GPTQ's own format (quant_method gptq, checkpoint_format gptq, desc_act false): per projection
          qweight, qzeros, scales, g_idx (worker/model/int4_weights.gptq_tensors)
    fp8   compressed-tensors, float-quantized (llm-compressor's FP8 "dynamic" scheme): per projection an
          e4m3 `weight` and its per-output-channel `weight_scale` [N, 1]; activations quantized per
          token at run time, as --quantization fp8 does
Both load in a worker as published (shared/quantization.py, shared/int4_quantization.py)."""

from __future__ import annotations

from typing import Any

import torch

from kernels.quant.gptq import gptq_fp8, gptq_int4
from kernels.quant.int4_reference import Int4Weight, dequantize_int4
from kernels.quant.reference import dequantize
from worker.model.int4_weights import gptq_tensors


class Int4Target:
    """4-bit affine weights in groups of `group_size` inputs."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def describe(self) -> str:
        return f"4-bit in groups of {self.group_size}"

    def rounds(self, projection: str) -> bool:
        """Whether the projection of checkpoint name `projection` is rounded: every one is."""
        return True

    def quantize(self, weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, Int4Weight]:
        """(the weight [N, K] as rounded, float32, the Int4Weight standing for it)."""
        _, quantized = gptq_int4(weight, hessian, self.group_size)
        return dequantize_int4(quantized), quantized

    def tensors(self, quantized: Int4Weight, rows: slice) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (by suffix) of output `rows` of `quantized` (one packed slice)."""
        columns = Int4Weight(
            qweight=quantized.qweight[:, rows],
            scales=quantized.scales[:, rows],
            zeros=quantized.zeros[:, rows],
            arrivals=quantized.arrivals,
        )
        return gptq_tensors(columns)

    def quantization_config(self) -> dict[str, Any]:
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": self.group_size,
            "desc_act": False,
            "sym": False,
            "static_groups": True,  # the grids set before rounding, columns in act order (kernels/quant/gptq.py)
            "true_sequential": False,
            "checkpoint_format": "gptq",
        }


class Fp8Target:
    """FP8 e4m3 weights with one scale per output channel, but for the projections `unquantized`
    (checkpoint names), which keep the source's weights and are named in the config's ignore list."""

    def __init__(self, unquantized: tuple[str, ...] = ()) -> None:
        self.unquantized = unquantized

    def describe(self) -> str:
        left = f", {len(self.unquantized)} projections left unquantized" if self.unquantized else ""
        return f"FP8 e4m3 with a scale per output channel{left}"

    def rounds(self, projection: str) -> bool:
        """Whether the projection of checkpoint name `projection` is rounded."""
        return projection not in self.unquantized

    def quantize(
        self, weight: torch.Tensor, hessian: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(the weight [N, K] as rounded, float32, (fp8 codes [N, K], float32 scales [N]))."""
        codes, scales = gptq_fp8(weight, hessian)
        return dequantize(codes, scales), (codes, scales)

    def tensors(self, quantized: tuple[torch.Tensor, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
        codes, scales = quantized
        return {"weight": codes[rows].contiguous(), "weight_scale": scales[rows, None].contiguous()}

    def quantization_config(self) -> dict[str, Any]:
        scheme = {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": scheme},
            "ignore": ["lm_head", *self.unquantized],
        }


GptqTarget = Int4Target | Fp8Target
