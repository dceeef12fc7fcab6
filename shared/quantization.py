"""How a base model's weights and KV cache are stored on the device, read from its checkpoint's
`quantization_config` and the worker's settings, without torch.

A checkpoint either holds plain bf16/fp16/fp32 weights ("none": quantized at load if the worker is
asked for fp8) or FP8 weights with their scales, as published in two formats:
    quant_method "fp8"                 (AutoFP8 / transformers): `weight_scale` or `weight_scale_inv`
    quant_method "compressed-tensors"  (llm-compressor, format float-quantized): `weight_scale`
each per tensor (one value) or per output channel ([N] or [N, 1]), which load as they are, never
re-quantized; or per block of weights (`weight_block_size` [bn, bk], as DeepSeek and Qwen publish
FP8 checkpoints; compressed-tensors' strategy "block" with its `block_structure`), one scale per
bn outputs × bk inputs ([ceil(N / bn), ceil(K / bk)]). The kernels take one scale per output channel,
so a block-wise weight is dequantized at load and quantized again per channel
(worker/model/fp8_weights.py): one more rounding onto e4m3, and no kernel of its own to keep.
Their static `input_scale`s are not used: activations get a dynamic scale per token,
never coarser than one fixed scale per tensor. Projections a checkpoint names as left unquantized
(compressed-tensors' `ignore`, transformers' `modules_to_not_convert`, AutoFP8's `ignored_layers`)
are served in the checkpoint's dtype beside the FP8 ones (checkpoint_unquantized). 4-bit checkpoints
(quant_method "awq" or "gptq") are checked by shared/int4_quantization.py, bitsandbytes' ("bitsandbytes",
4-bit NF4 or FP4) by shared/bnb_quantization.py. Anything else is refused at start, naming the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from shared.bnb_quantization import BNB_METHOD, check_bnb_checkpoint
from shared.errors import ErrorCode, LorafleetError
from shared.int4_quantization import INT4_METHODS, check_int4_checkpoint

# what --quantization asks for ("none": the checkpoint's own floating-point dtype)
WEIGHT_FORMATS = ("none", "fp8", "int4", "nf4")
KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the weights' activation dtype
SUPPORTED_METHODS = ("fp8", "compressed-tensors", *INT4_METHODS, BNB_METHOD)
# compressed-tensors' per-tensor, per-output-channel and block-wise weight strategies (group is refused)
_CT_STRATEGIES = ("tensor", "channel", "block")


def checkpoint_quantization(config: dict[str, Any], path: Path) -> str:
    """The weight format of the checkpoint whose config.json (at `path`) is `config`: "none", "fp8",
    "awq", "gptq", "nf4" or "fp4".
    Raises LorafleetError naming the file and the problem for a format the worker cannot serve."""
    quant = config.get("quantization_config")
    if not quant:
        return "none"
    method = quant.get("quant_method")
    if method == "fp8":
        checkpoint_scale_block(config, path)  # checked here, read by ModelInfo
        return "fp8"
    if method == "compressed-tensors":
        for name, group in (quant.get("config_groups") or {}).items():
            _check_ct_group(name, group, path)
        if not quant.get("config_groups"):
            _refuse(path, "compressed-tensors quantization_config has no config_groups")
        checkpoint_scale_block(config, path)
        return "fp8"
    if method in INT4_METHODS:
        return check_int4_checkpoint(quant, path)
    if method == BNB_METHOD:
        return check_bnb_checkpoint(quant, path)
    _refuse(path, f"quant_method {method!r} is not supported (supported: {', '.join(SUPPORTED_METHODS)})")


def _check_ct_group(name: str, group: dict[str, Any], path: Path) -> None:
    weights = group.get("weights") or {}
    kind = f"{weights.get('type')} {weights.get('num_bits')}-bit"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        _refuse(path, f"compressed-tensors group {name!r} holds {kind} weights; only FP8 (float 8-bit) is supported")
    if weights.get("strategy") not in _CT_STRATEGIES:
        _refuse(path, f"compressed-tensors group {name!r} has weight strategy {weights.get('strategy')!r}; "
                      f"supported: {', '.join(_CT_STRATEGIES)}")  # fmt: skip
    if not weights.get("symmetric", True):
        _refuse(path, f"compressed-tensors group {name!r} has asymmetric FP8 weights (zero points): not supported")


def checkpoint_scale_block(config: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """(outputs, inputs) of the weight blocks sharing one scale in a block-wise FP8 checkpoint whose
    config.json (at `path`) is `config`; None for any other checkpoint. Raises LorafleetError for a
    block that is not two positive integers, or for groups of a compressed-tensors checkpoint that
    disagree on it (one block size serves every projection)."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        blocks = [quant["weight_block_size"]] if quant.get("weight_block_size") else []
    elif quant.get("quant_method") == "compressed-tensors":
        groups = (quant.get("config_groups") or {}).values()
        weights = [group.get("weights") or {} for group in groups]
        blocks = [spec.get("block_structure") for spec in weights if spec.get("strategy") == "block"]
        if blocks and len(blocks) != len(weights):
            _refuse(path, "compressed-tensors groups mix block-wise and other FP8 weight scales")
    else:
        return None
    for block in blocks:
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(_positive_int(side) for side in block)):
            _refuse(path, f"FP8 weight block {block!r} is not two positive integers [outputs, inputs]")
    if len({tuple(block) for block in blocks}) > 1:
        _refuse(path, f"compressed-tensors groups disagree on the FP8 weight block: {blocks}")
    return (int(blocks[0][0]), int(blocks[0][1])) if blocks else None


def checkpoint_unquantized(config: dict[str, Any], path: Path, names: Iterable[str]) -> tuple[str, ...]:
    """Those of `names` (modules as the checkpoint names them, `model.layers.0.self_attn.q_proj`)
    that the FP8 checkpoint whose config.json (at `path`) is `config` leaves in its own dtype, in the
    order given: compressed-tensors' `ignore` (whole names, or `re:` patterns matched from a name's
    start, as compressed-tensors matches them), transformers' `modules_to_not_convert` (as transformers
    matches them: a regular expression from a name's start to a module boundary, so `model.layers.1`
    is not `model.layers.11` and `mlp.gate` not `mlp.gate_proj`, or a suffix) and AutoFP8's
    `ignored_layers` (whole names). () for any other checkpoint. Entries naming modules never
    quantized (`lm_head`, a router) match none of `names`. Raises LorafleetError for a list that is
    not of strings, or a pattern that is not a regular expression."""
    quant = config.get("quantization_config") or {}
    keys = {"compressed-tensors": ("ignore",), "fp8": ("ignored_layers", "modules_to_not_convert")}
    whole: list[str] = []
    suffixes: list[str] = []
    patterns: list[re.Pattern[str]] = []
    for key in keys.get(quant.get("quant_method"), ()):
        entries = quant.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries):
            _refuse(path, f"quantization_config.{key} must be a list of module names")
        for entry in entries:
            if key == "modules_to_not_convert":
                suffixes.append(entry)
                pattern = rf"(?:{entry})(?:(?<=\.)|(?=\.|$))"  # up to a module boundary
            elif entry.startswith("re:"):
                pattern = entry.removeprefix("re:")
            else:
                whole.append(entry)
                continue
            try:
                patterns.append(re.compile(pattern))
            except re.error as exc:
                _refuse(path, f"quantization_config.{key} entry {entry!r} is not a regular expression: {exc}")
    return tuple(
        name
        for name in names
        if name in whole or any(p.match(name) for p in patterns) or any(name.endswith(s) for s in suffixes)
    )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def served_quantization(checkpoint: str, requested: str | None, path: Path) -> str:
    """The format the weights are served in: the checkpoint's when it is quantized, else `requested`
    (--quantization; None: the checkpoint's own dtype). A quantized checkpoint cannot be served
    unquantized; an AWQ or GPTQ one is already what --quantization int4 asks for, a bitsandbytes NF4
    one what --quantization nf4 asks for."""
    if checkpoint != "none":
        if requested not in (None, checkpoint) and not (requested == "int4" and checkpoint in INT4_METHODS):
            _refuse(
                path, f"the checkpoint is {checkpoint}-quantized; it cannot be served as --quantization {requested}"
            )
        return checkpoint
    return requested or "none"


def _refuse(path: Path, problem: str) -> NoReturn:
    raise LorafleetError(ErrorCode.INVALID_REQUEST, f"{path}: {problem}")
