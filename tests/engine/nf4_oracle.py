"""bitsandbytes 4-bit checkpoints (NF4, FP4; double quantization) written from a saved tiny model, and
the oracle over their dequantized weights.

The files are written the way bitsandbytes' Linear4bit saves its QuantState (QuantState.as_dict
(packed=True) under `….weight.`, quantize_4bit's codes and absmax, quantize_blockwise with the
dynamic 8-bit map for double quantization), transcribed here step by step (not through
kernels/quant's quantizer and packer, so the loader's unpacking is checked against the format, not
against itself). The oracle dequantizes what the files hold, in float32, as bitsandbytes'
dequantize_4bit computes it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file

from kernels.quant.codebook import NF4_CODES
from tests.engine.fp8_oracle import _is_base_projection
from tests.engine.int4_oracle import write_quantized_checkpoint

BLOCK = 64  # bitsandbytes' default
NESTED_BLOCK = 256  # quantize_4bit's block for the 8-bit absmax codes
_FP4_LEVELS = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


def quant_map(quant_type: str) -> torch.Tensor:
    """bitsandbytes' get_4bit_type: the 16 levels divided by their largest magnitude, float32."""
    levels = torch.tensor(NF4_CODES if quant_type == "nf4" else _FP4_LEVELS, dtype=torch.float32)
    return levels / levels.abs().max()


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): float32 [256]."""
    data: list[float] = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _nearest(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The index of the level nearest each value (the lower on a tie: bucketize on the midpoints)."""
    order = torch.argsort(levels)
    midpoints = (levels[order[:-1]] + levels[order[1:]]) / 2
    return order[torch.bucketize(values, midpoints)]


def _blockwise(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values scaled into [-1, 1], float32 absmax per block) of a flat tensor, the last block partial."""
    padded = torch.nn.functional.pad(flat, (0, -len(flat) % block)).reshape(-1, block)
    absmax = padded.abs().amax(dim=1)
    scaled = (padded * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1)[: len(flat)]
    return scaled, absmax


def bnb_tensors(weight: torch.Tensor, quant_type: str, *, double_quant: bool) -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes saves for a Linear4bit weight [N, K], by their names after `weight`."""
    flat = weight.float().reshape(-1)
    scaled, absmax = _blockwise(flat, BLOCK)
    codes = _nearest(scaled, quant_map(quant_type)).to(torch.uint8)
    packed = ((codes[0::2] << 4) | codes[1::2]).unsqueeze(1)  # [N*K/2, 1]: the even code high
    state: dict[str, object] = {
        "quant_type": quant_type,
        "blocksize": BLOCK,
        "dtype": str(weight.dtype).removeprefix("torch."),
        "shape": list(weight.shape),
    }
    tensors = {"": packed, ".absmax": absmax, ".quant_map": quant_map(quant_type)}
    if double_quant:
        offset = absmax.mean()
        nested_scaled, nested_absmax = _blockwise(absmax - offset, NESTED_BLOCK)
        tensors[".absmax"] = _nearest(nested_scaled, dynamic_map()).to(torch.uint8)
        tensors[".nested_absmax"] = nested_absmax
        tensors[".nested_quant_map"] = dynamic_map()
        state.update(nested_blocksize=NESTED_BLOCK, nested_dtype="float32", nested_offset=offset.item())
    tensors[f".quant_state.bitsandbytes__{quant_type}"] = torch.tensor(
        list(json.dumps(state).encode()), dtype=torch.uint8
    )
    return tensors


def dequantize_bnb(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 [N, K]: the weight a projection's saved tensors (bnb_tensors' names) stand for, as
    bitsandbytes' dequantize_4bit computes it."""
    (state_name,) = (name for name in tensors if ".quant_state." in name)
    state = json.loads(bytes(tensors[state_name].tolist()).decode())
    packed = tensors[""].reshape(-1)
    codes = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1).long()
    absmax = tensors[".absmax"]
    if "nested_blocksize" in state:
        nested = tensors[".nested_absmax"].repeat_interleave(state["nested_blocksize"])[: len(absmax)]
        absmax = tensors[".nested_quant_map"][absmax.long()] * nested + torch.tensor(state["nested_offset"])
    values = quant_map(state["quant_type"])[codes] * absmax.repeat_interleave(state["blocksize"])
    return values.reshape(state["shape"])


def save_bnb_checkpoint(
    model_dir: Path, directory: Path, *, quant_type: str = "nf4", double_quant: bool = False
) -> Path:
    """The plain checkpoint in `model_dir` written to `directory` as transformers saves a
    `load_in_4bit` model: every projection 4-bit, the rest as it was, and the quantization_config."""

    def quantized(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        saved = bnb_tensors(tensor, quant_type, double_quant=double_quant)
        return {name + suffix: value for suffix, value in saved.items()}

    config = bnb_config(quant_type=quant_type, double_quant=double_quant)
    return write_quantized_checkpoint(model_dir, directory, quantized, config)


def bnb_config(*, quant_type: str = "nf4", double_quant: bool = False, **fields: object) -> dict:
    """BitsAndBytesConfig(load_in_4bit=True, ...).to_dict() as transformers writes it, with `fields` changed."""
    config = {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": "float32",
        "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": quant_type,
        "bnb_4bit_use_double_quant": double_quant,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": None,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }
    return {**config, **fields}


def projection_tensors(saved: dict[str, torch.Tensor], weight: str) -> dict[str, torch.Tensor]:
    """A saved projection's tensors (of a checkpoint's `saved` ones) by their names after `weight`
    (`….q_proj.weight`)."""
    return {name.removeprefix(weight): tensor for name, tensor in saved.items() if name.startswith(weight)}


def bnb_oracle(oracle: PeftModel, model_dir: Path) -> PeftModel:
    """A copy of `oracle` whose base projections hold the dequantized weights of the bitsandbytes
    checkpoint in `model_dir`."""
    quantized = copy.deepcopy(oracle)
    saved = load_file(model_dir / "model.safetensors")
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, torch.nn.Linear) and _is_base_projection(name):
                weight = name.removeprefix("base_model.model.").removesuffix(".base_layer") + ".weight"
                module.weight.copy_(dequantize_bnb(projection_tensors(saved, weight)))
    return quantized
