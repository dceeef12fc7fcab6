"""A bitsandbytes 4-bit checkpoint's tensors checked at start, without torch: every projection of every
layer has the tensors bitsandbytes saves for it (shared/bnb_quantization.py), each of the dtype and
shape its widths give, and a quant state (read: a few hundred bytes of JSON each) of the config's
quant type and double quantization, the block size the model is built with, and the projection's
shape. A missing tensor names the checkpoint, a wrong one the file holding it, before any weight
is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from shared.bnb_quantization import QUANT_STATE_SUFFIX, block_size, read_quant_state
from shared.checkpoint_tables import checkpoint_tables
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import PROJECTIONS, ModelInfo, decoder_projection_name
from shared.safetensors_table import TensorEntry

_CODEBOOK_SIZE = 16
_NESTED_CODEBOOK_SIZE = 256  # double quantization's 8-bit absmax codes


def check_bnb_tensors(model_dir: Path, info: ModelInfo) -> None:
    """Raise LorafleetError naming the checkpoint (or the file) and the tensor unless every
    projection's tensors are there as bitsandbytes saves a `info.checkpoint_quantization` ("nf4" or
    "fp4") weight in blocks of info.weight_group_size, double-quantized if info.weight_double_quant."""
    model_dir = Path(model_dir)
    tables = checkpoint_tables(model_dir)
    quant_type, block, nested = info.checkpoint_quantization, info.weight_group_size, info.weight_double_quant
    what = f"a bitsandbytes {quant_type} checkpoint" + (" with double quantization" if nested else "")
    for layer in range(info.num_layers):
        for projection in PROJECTIONS:
            k, n = info.projection_shape(projection)
            weight = f"{decoder_projection_name(layer, projection)}.weight"
            state_name = weight + QUANT_STATE_SUFFIX.removeprefix(".weight") + quant_type
            path, entry = _entry(model_dir, tables, state_name, what)
            state = read_quant_state(path, state_name, entry)
            _check_state(state, path, state_name, quant_type, block, nested, (n, k))
            blocks = n * k // block
            expected = {
                weight: ("U8", (n * k // 2, 1)),
                f"{weight}.absmax": ("U8" if nested else "F32", (blocks,)),
                f"{weight}.quant_map": ("F32", (_CODEBOOK_SIZE,)),
            }
            if nested:
                nested_blocks = -(-blocks // state["nested_blocksize"])
                expected[f"{weight}.nested_absmax"] = ("F32", (nested_blocks,))
                expected[f"{weight}.nested_quant_map"] = ("F32", (_NESTED_CODEBOOK_SIZE,))
            for name, (dtype, shape) in expected.items():
                path, entry = _entry(model_dir, tables, name, what)
                if entry.dtype != dtype or entry.shape != shape:
                    _refuse(path, f"{name} is {entry.dtype} {list(entry.shape)}; {what} in blocks of {block} "
                                  f"needs {dtype} {list(shape)}")  # fmt: skip


def _check_state(
    state: dict[str, Any], path: Path, name: str, quant_type: str, block: int, nested: bool, shape: tuple[int, int]
) -> None:
    """One quant state against what the config and the model say."""
    if state.get("quant_type") != quant_type:
        _refuse(path, f"{name}: quant_type {state.get('quant_type')!r}, but config.json says {quant_type!r}")
    if block_size(state, path, name) != block:
        _refuse(path, f"{name}: blocksize {state['blocksize']}, but the checkpoint's first quant state has {block}")
    if state.get("shape") != list(shape):
        _refuse(path, f"{name}: shape {state.get('shape')}, but the model's projection is {list(shape)}")
    if ("nested_blocksize" in state) != nested:
        saved = "double-quantized" if "nested_blocksize" in state else "not double-quantized"
        _refuse(path, f"{name} is {saved}, against config.json's bnb_4bit_use_double_quant")
    if nested:
        if not isinstance(state["nested_blocksize"], int) or state["nested_blocksize"] < 1:
            _refuse(path, f"{name}: nested_blocksize {state['nested_blocksize']!r} is not a block size")
        if state.get("nested_dtype") != "float32" or not isinstance(state.get("nested_offset"), int | float):
            _refuse(path, f"{name}: double quantization needs nested_dtype 'float32' and a numeric nested_offset")


def _entry(
    model_dir: Path, tables: dict[str, tuple[Path, TensorEntry]], name: str, what: str
) -> tuple[Path, TensorEntry]:
    if name not in tables:
        _refuse(
            model_dir, f"{name} is missing: {what} holds weight, absmax, quant_map and a quant state per projection"
        )
    return tables[name]


def _refuse(path: Path, problem: str) -> NoReturn:
    raise LorafleetError(ErrorCode.INVALID_REQUEST, f"{path}: {problem}")
