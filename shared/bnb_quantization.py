"""bitsandbytes 4-bit checkpoints (transformers' `load_in_4bit` models, saved), read without torch.

quantization_config: quant_method "bitsandbytes", load_in_4bit true, bnb_4bit_quant_type "nf4" or
"fp4" (transformers' default when absent: "fp4"), bnb_4bit_use_double_quant, bnb_4bit_quant_storage
"uint8". Each 4-bit projection W [N, K] is saved as bitsandbytes' Linear4bit saves its QuantState
(`QuantState.as_dict(packed=True)` under `{projection}.weight.`):
    weight                                uint8 [N*K/2, 1]  the codes of W flattened row-major, two a
                                                            byte, the first in the high nibble
    weight.absmax                         float32 [N*K/B]   one per block of B consecutive codes
                                                            (uint8 [N*K/B] with double quantization)
    weight.quant_map                      float32 [16]      the codebook (bitsandbytes' own table)
    weight.quant_state.bitsandbytes__nf4  uint8 [bytes]     UTF-8 JSON: quant_type, blocksize B, dtype,
                                                            shape [N, K]; with double quantization
                                                            also nested_blocksize, nested_dtype,
                                                            nested_offset (…__fp4 for FP4)
    weight.nested_absmax                  float32 [cdiv(N*K/B, nested_blocksize)]   double quantization:
    weight.nested_quant_map               float32 [256]     absmax[i] = nested_quant_map[absmax code i]
                                                            * nested_absmax[i // nested_blocksize] + nested_offset
W[n, k] = quant_map[code] * absmax[(n*K + k) // B]: with K a multiple of B, blocks run along K within
one output, the group-wise codebook layout of kernels/quant (worker/model/bnb_weights.py repacks it).
The block size is not in the config; it is read from the first projection's quant state
(`checkpoint_block_size`), and every projection's is checked at start (shared/bnb_tensors.py).
8-bit bitsandbytes (LLM.int8), quant storage other than uint8 and unknown quant types are refused at
start naming config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from shared.checkpoint_tables import checkpoint_tables, tensor_bytes
from shared.errors import ErrorCode, LorafleetError
from shared.int4_quantization import CODEBOOK_FORMATS
from shared.safetensors_table import TensorEntry

BNB_METHOD = "bitsandbytes"
# what --quantization nf4 quantizes a plain checkpoint in: bitsandbytes' default block (Linear4bit,
# transformers' load_in_4bit)
LOAD_BLOCK_SIZE = 64
# bitsandbytes' block sizes (quantize_4bit); every one is whole K tiles of the W4A16 kernels
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# the quant state tensor of a projection, by quant type
QUANT_STATE_SUFFIX = ".weight.quant_state.bitsandbytes__"
_MAX_QUANT_STATE_BYTES = 1 << 16  # a quant state's JSON is a few hundred bytes


def check_bnb_checkpoint(quant: dict[str, Any], path: Path) -> str:
    """The codebook ("nf4" or "fp4") of a bitsandbytes checkpoint's quantization_config `quant`, after
    checking the worker can serve it; raises LorafleetError naming `path` and the problem."""
    if quant.get("load_in_8bit") or quant.get("_load_in_8bit"):
        _refuse(path, "8-bit bitsandbytes weights (load_in_8bit, LLM.int8) are not supported; 4-bit NF4 and FP4 are")
    if not (quant.get("load_in_4bit") or quant.get("_load_in_4bit")):
        _refuse(path, "a bitsandbytes quantization_config without load_in_4bit true is not supported")
    quant_type = quant.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in CODEBOOK_FORMATS:
        _refuse(path, f"bnb_4bit_quant_type {quant_type!r} is not supported (supported: {', '.join(CODEBOOK_FORMATS)})")
    storage = quant.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        _refuse(path, f"bnb_4bit_quant_storage {storage!r} is not supported: only 'uint8'")
    return quant_type


def checkpoint_block_size(model_dir: Path, quant_type: str) -> int:
    """The block size B of a bitsandbytes checkpoint in `model_dir`, from the first quant state of
    `quant_type` its files hold; raises LorafleetError naming the checkpoint or the file."""
    for name, (path, entry) in checkpoint_tables(Path(model_dir)).items():
        if name.endswith(QUANT_STATE_SUFFIX + quant_type):
            return block_size(read_quant_state(path, name, entry), path, name)
    _refuse(
        model_dir, f"no tensor ends in {QUANT_STATE_SUFFIX + quant_type}: not a bitsandbytes {quant_type} checkpoint"
    )


def block_size(state: dict[str, Any], path: Path, name: str) -> int:
    """A quant state's block size, checked to be one the kernels take."""
    block = state.get("blocksize")
    if block not in BLOCK_SIZES:
        _refuse(path, f"{name}: blocksize {block} is not supported (supported: {', '.join(map(str, BLOCK_SIZES))})")
    return block


def read_quant_state(path: Path, name: str, entry: TensorEntry) -> dict[str, Any]:
    """The JSON object a quant state tensor (uint8 [bytes], at `entry` of the file `path`) holds."""
    if entry.dtype != "U8" or len(entry.shape) != 1 or entry.end - entry.begin > _MAX_QUANT_STATE_BYTES:
        _refuse(path, f"{name} is {entry.dtype} {list(entry.shape)}; a quant state is U8 [bytes] of JSON")
    try:
        state = json.loads(tensor_bytes(path, entry).decode("utf-8"))
    except ValueError as exc:
        _refuse(path, f"{name} is not UTF-8 JSON ({type(exc).__name__})")
    if not isinstance(state, dict):
        _refuse(path, f"{name} is not a JSON object")
    return state


def _refuse(path: Path, problem: str) -> NoReturn:
    raise LorafleetError(ErrorCode.INVALID_REQUEST, f"{path}: {problem}")
