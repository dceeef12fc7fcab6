"""FP8 checkpoints and the FP8 oracle for the engine tests.

The oracle is transformers + PEFT computing exactly what the FP8 base computes, in float32: each
base projection's weight replaced by its dequantized fp8 weight and, in a forward of more than
W8A16_MAX_TOKENS tokens (W8A8, kernels/quant), its input (only the base layer's: PEFT's lora_A reads
the unquantized activations, as the engine's adapters do) replaced by the per-token
quantized-then-dequantized activations, by a forward pre-hook. The oracle runs one sequence at a
time and the engine a batch: a test compares them where both are on the same side of the threshold
(batches of at most W8A16_MAX_TOKENS tokens, or one long sequence alone).

MoE experts (W8A16, fp8_moe_oracle): each expert's gate, up and down weights replaced by their
dequantized fp8 weights, their inputs left unquantized, as the engine's grouped GEMM reads them.

Pre-quantized checkpoints are written here in the two published formats, from a saved tiny model
(dense or MoE: every expert's projections are quantized too), with per-tensor, per-channel or
block-wise weight scales (blocks of BLOCK, which divide none of the tiny models' widths, so edge
blocks are partial; the oracle's weights are then what the loader serves: dequantized by block and
quantized again per row); for the FP8 KV cache, checkpoints with
published KV cache scales, and a reparametrisation of a model whose K/V are small.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from kernels.quant import dequantize, quantize_weight
from kernels.quant.reference import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    W8A16_MAX_TOKENS,
    dequantize_blocks,
    quantize_per_token_reference,
)
from shared.model_info import PROJECTIONS

BLOCK = (24, 40)  # (outputs, inputs) per scale of the block-wise checkpoints written here


def _is_base_projection(name: str) -> bool:
    """The nn.Linear a projection's weight lives in: PEFT's `q_proj.base_layer`, or a bare `q_proj`."""
    parts = name.split(".")
    return parts[-1] in PROJECTIONS or (parts[-1] == "base_layer" and parts[-2] in PROJECTIONS)


def _fake_quantize_input(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    (x, *rest) = args
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= W8A16_MAX_TOKENS:  # W8A16: the activations stay as they are
        return args
    return (dequantize(*quantize_per_token_reference(rows)).to(x.dtype).view(x.shape), *rest)


def fp8_oracle(
    oracle: PeftModel,
    scales: str = "channel",
    *,
    quantize_activations: bool = True,
    unquantized: tuple[str, ...] = (),
) -> PeftModel:
    """A copy of `oracle` computing as the FP8 base does: per-channel ("channel") or per-tensor
    ("tensor") weight scales, per-token activation scales past W8A16_MAX_TOKENS tokens (never with
    `quantize_activations` off: the weights alone, to show that a test's activations were quantized);
    the projections named in `unquantized` (checkpoint names) left as they are."""
    quantized = copy.deepcopy(oracle)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            left = name.removesuffix(".base_layer").endswith(tuple(f".{projection}" for projection in unquantized))
            if isinstance(module, torch.nn.Linear) and _is_base_projection(name) and not left:
                module.weight.copy_(dequantize(*quantize(module.weight, scales)))
                if quantize_activations:
                    module.register_forward_pre_hook(_fake_quantize_input)
    return quantized


def fp8_moe_oracle(oracle: PeftModel, width: int, scales: str = "channel") -> PeftModel:
    """fp8_oracle(oracle, scales) with every expert's projections quantized too: transformers 5's
    fused expert parameters gate_up [E, 2I, H] (gate and up quantized apart, as the checkpoint holds
    them; I = `width`) and down [E, H, I]."""
    quantized = fp8_oracle(oracle, scales)
    with torch.no_grad():
        for name, param in quantized.named_parameters():
            if param.dim() != 3 or ".experts." not in name or "lora" in name:
                continue
            halves = (slice(0, width), slice(width, None)) if name.endswith("gate_up_proj") else (slice(None),)
            for expert in range(param.shape[0]):
                for rows in halves:
                    param[expert, rows] = dequantize(*quantize(param[expert, rows], scales))
    return quantized


def quantize(weight: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scales [N]) of weight [N, K] as served: one scale per row, one for the
    tensor, or ("block") the block-wise checkpoint's weight dequantized and quantized per row."""
    if scales == "channel":
        return quantize_weight(weight)
    if scales == "block":
        return quantize_weight(dequantize_blocks(*quantize_blocks(weight), BLOCK))
    scale = (weight.abs().max().float() / FP8_MAX).reshape(1)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.expand(weight.shape[0])


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scales [ceil(N / BLOCK[0]), ceil(K / BLOCK[1])]) of weight [N, K], one
    scale per block: each block's absolute maximum over FP8_MAX, as block-wise checkpoints hold them."""
    rows, columns = BLOCK
    n, k = weight.shape
    padded = torch.zeros(-(-n // rows) * rows, -(-k // columns) * columns)
    padded[:n, :k] = weight.float()
    peak = padded.abs().reshape(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns).amax(dim=(1, 3))
    block_scales = (peak / FP8_MAX).clamp(min=MIN_SCALE)
    per_weight = block_scales.repeat_interleave(rows, dim=0)[:n].repeat_interleave(columns, dim=1)[:, :k]
    return (weight.float() / per_weight).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), block_scales


def save_fp8_checkpoint(
    model_dir: Path,
    directory: Path,
    *,
    method: str,
    scales: str,
    unquantized: tuple[str, ...] = (),
    ignore: dict[str, list[str]] | None = None,
) -> Path:
    """The plain checkpoint in `model_dir` written to `directory` pre-quantized, as `method` ("fp8":
    transformers / AutoFP8, or "compressed-tensors") publishes it, with per-"channel", per-"tensor"
    or per-"block" weight scales (and the static input scales both formats carry, which the engine
    does not use). The "fp8" format names block scales `weight_scale_inv`, as DeepSeek's and Qwen's
    checkpoints do. The projections named in `unquantized` (checkpoint names) keep their weights, and
    `ignore` (quantization_config key → entries) says so in the config."""
    directory.mkdir(parents=True)
    tensors = load_file(model_dir / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        expert = len(parts) > 4 and parts[-4] == "experts"  # `experts.{e}.w1.weight`: Mixtral's names too
        if (
            parts[-1] != "weight"
            or not (parts[-2] in PROJECTIONS or expert)
            or name.removesuffix(".weight") in unquantized
        ):
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if scales == "block":
            out[name], block_scales = quantize_blocks(tensor)
            out[f"{prefix}.weight_scale_inv" if method == "fp8" else f"{prefix}.weight_scale"] = block_scales
        else:
            out[name], row_scales = quantize(tensor, scales)
            out[f"{prefix}.weight_scale"] = row_scales[:1].reshape(()) if scales == "tensor" else row_scales.view(-1, 1)
        out[f"{prefix}.input_scale"] = torch.tensor(0.05)
    save_file(out, directory / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = _quantization_config(method, scales) | (ignore or {})
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "tokenizer.json", directory / "tokenizer.json")
    return directory


def _quantization_config(method: str, scales: str) -> dict:
    if method == "fp8":
        blocks = {"weight_block_size": list(BLOCK)} if scales == "block" else {}
        return {"quant_method": "fp8", "activation_scheme": "static", **blocks}
    weights = {"num_bits": 8, "type": "float", "strategy": scales, "symmetric": True, "dynamic": False}
    if scales == "block":
        weights["block_structure"] = list(BLOCK)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            }
        },
        "ignore": ["lm_head"],
    }


def save_small_kv_checkpoint(model_dir: Path, directory: Path, *, factor: float) -> Path:
    """The plain checkpoint in `model_dir` written to `directory` computing the same function with K
    and V `factor` times smaller: k_proj and v_proj scaled by `factor`, q_proj and o_proj by its
    inverse (q · k and o_proj(v) unchanged; exactly so for a power of two). Its K/V fall into e4m3's
    subnormals, where an unscaled fp8 cache loses them."""
    directory.mkdir(parents=True)
    tensors = load_file(model_dir / "model.safetensors")
    rescale = {"k_proj": factor, "v_proj": factor, "q_proj": 1 / factor}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[-2] in rescale:  # weight and bias alike
            tensors[name] = tensor * rescale[parts[-2]]
        elif parts[-2] == "o_proj" and parts[-1] == "weight":  # its bias adds after: unchanged
            tensors[name] = tensor / factor
    save_file(tensors, directory / "model.safetensors")
    for file in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / file, directory / file)
    return directory


def save_published_kv_scales(model_dir: Path, directory: Path, scales: dict[str, torch.Tensor]) -> Path:
    """The checkpoint in `model_dir` written to `directory` with `scales` added: checkpoint name →
    a published KV cache scale (`model.layers.{i}.self_attn.k_scale`, …)."""
    directory.mkdir(parents=True)
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, **scales}, directory / "model.safetensors")
    for file in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / file, directory / file)
    return directory
