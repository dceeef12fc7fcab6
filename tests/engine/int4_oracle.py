"""4-bit checkpoints and the W4A16 oracle for the engine tests.

The oracle is transformers + PEFT over the dequantized base: each base projection's weight replaced
by (q - zero) * scale of its 4-bit quantization, in float32 (activations stay as they are: A16).
PEFT's adapters are untouched, as the engine's are.

AWQ and GPTQ checkpoints are written here from a saved tiny model, packed the way AutoAWQ's
WQLinear_GEMM.from_linear and AutoGPTQ's QuantLinear.pack write them, transcribed loop by loop
(not through kernels/quant's packers, so the loader's unpacking is checked against the formats,
not against itself).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from kernels.quant.int4_reference import quantize_int4
from shared.model_info import PROJECTIONS
from tests.engine.fp8_oracle import _is_base_projection

GROUP_SIZE = 128
# the tiny model's widths as whole groups of 128: head_dim 32, 4 query and 2 KV heads
INT4_SHAPE = {"hidden_size": 128, "intermediate_size": 256}


def dequantized(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """float32 [N, K]: weight [N, K] quantized as --quantization int4 does, then (q - zero) * scale."""
    levels, packed = quantize_int4(weight, group_size)  # levels [K, N]
    scales = packed.scales.float().repeat_interleave(group_size, dim=0)
    zeros = packed.zeros.float().repeat_interleave(group_size, dim=0)
    return ((levels.float() - zeros) * scales).T


def int4_oracle(oracle: PeftModel, group_size: int = GROUP_SIZE) -> PeftModel:
    """A copy of `oracle` whose base projections hold their 4-bit weights (in groups of
    `group_size`), dequantized."""
    quantized = copy.deepcopy(oracle)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, torch.nn.Linear) and _is_base_projection(name):
                module.weight.copy_(dequantized(module.weight, group_size))
    return quantized


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of int values [R, C] into int32 [R, C / 8] (its order_map loop)."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return packed


def _gptq_pack_rows(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight packing of int values [K, N] into int32 [K / 8, N]: row k at bits 4 * (k % 8)."""
    packed = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int32)
    for row in range(values.shape[0] // 8):
        for j in range(8):
            packed[row] |= values[row * 8 + j].to(torch.int32) << (4 * j)
    return packed


def _gptq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qzeros packing of int values [R, N] into int32 [R, N / 8]: column n at bits 4 * (n % 8)."""
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(values.shape[1] // 8):
        for j in range(8):
            packed[:, col] |= (values[:, col * 8 + j].to(torch.int32) & 0xF) << (4 * j)
    return packed


def write_quantized_checkpoint(
    model_dir: Path, directory: Path, quantized: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict,
) -> Path:  # fmt: skip
    """The plain checkpoint in `model_dir` written to `directory`: each projection's weight replaced by
    `quantized(name, weight)` (its tensors by full name), the rest as it was, and `quantization_config`
    in config.json."""
    directory.mkdir(parents=True)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        parts = name.split(".")
        if parts[-1] != "weight" or parts[-2] not in PROJECTIONS:
            out[name] = tensor
        else:
            out.update(quantized(name, tensor))
    save_file(out, directory / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "tokenizer.json", directory / "tokenizer.json")
    return directory


def save_int4_checkpoint(model_dir: Path, directory: Path, *, method: str) -> Path:
    """The plain checkpoint in `model_dir` written to `directory` 4-bit quantized (as
    --quantization int4 quantizes: asymmetric, groups of 128), in `method`'s ("awq" or "gptq")
    published format."""

    def quantized(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        prefix = name.removesuffix(".weight")
        levels, packed = quantize_int4(tensor, GROUP_SIZE)  # levels [K, N]
        zeros = packed.zeros.to(torch.int32)  # [K / G, N]
        if method == "awq":
            return {f"{prefix}.scales": packed.scales, f"{prefix}.qweight": _awq_pack(levels),
                    f"{prefix}.qzeros": _awq_pack(zeros)}  # fmt: skip
        # GPTQ ("gptq" format) stores zero - 1; a zero point of 0 would not survive (its readers
        # add 1 to the 4-bit 15), which random groups that straddle zero never have
        assert bool((zeros > 0).all()), "a GPTQ checkpoint cannot hold a zero point of 0"
        return {
            f"{prefix}.scales": packed.scales,
            f"{prefix}.qweight": _gptq_pack_rows(levels),
            f"{prefix}.qzeros": _gptq_pack_columns(zeros - 1),
            f"{prefix}.g_idx": torch.arange(levels.shape[0], dtype=torch.int32) // GROUP_SIZE,
        }

    return write_quantized_checkpoint(model_dir, directory, quantized, quantization_config(method))


def quantization_config(method: str, **fields: object) -> dict:
    """`method`'s quantization_config as its tools write it, with `fields` changed."""
    if method == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "version": "gemm", "zero_point": True}
    else:
        config = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP_SIZE,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    return {**config, **fields}
