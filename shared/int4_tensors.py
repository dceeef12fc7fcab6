"""A 4-bit checkpoint's tensors checked at start from its safetensors headers alone (no data read,
no torch): every projection of every layer has its `qweight`, `qzeros` and `scales`, each of the
dtype and shape its format (shared/int4_quantization.py) gives for that projection's widths and
the config's group size. A missing tensor names the checkpoint, a wrong one the file holding it,
each with the tensor and what was expected, before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from shared.checkpoint_tables import checkpoint_tables
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import PROJECTIONS, ModelInfo, decoder_projection_name
from shared.safetensors_table import TensorEntry

_FLOAT_DTYPES = ("F16", "BF16", "F32")


def check_int4_tensors(model_dir: Path, info: ModelInfo) -> None:
    """Raise LorafleetError naming the checkpoint (or the file) and the tensor unless every
    projection's 4-bit tensors are there as `info.checkpoint_quantization` ("awq" or "gptq") lays
    them out, for groups of info.weight_group_size inputs."""
    tables = checkpoint_tables(Path(model_dir))
    method, group = info.checkpoint_quantization, info.weight_group_size
    for layer in range(info.num_layers):
        for projection in PROJECTIONS:
            k, n = info.projection_shape(projection)
            if n % 8:
                _refuse(model_dir, f"{projection}'s {n} outputs cannot be packed 8 to an int32, as {method} packs them")
            qweight = (k, n // 8) if method == "awq" else (k // 8, n)
            expected = {
                "qweight": (("I32",), qweight),
                "qzeros": (("I32",), (k // group, n // 8)),
                "scales": (_FLOAT_DTYPES, (k // group, n)),
            }
            for suffix, (dtypes, shape) in expected.items():
                name = f"{decoder_projection_name(layer, projection)}.{suffix}"
                _check(model_dir, tables, name, dtypes, shape, f"a {method} checkpoint in groups of {group}")


def _check(
    model_dir: Path,
    tables: dict[str, tuple[Path, TensorEntry]],
    name: str,
    dtypes: tuple[str, ...],
    shape: tuple[int, int],
    what: str,
) -> None:
    if name not in tables:
        _refuse(model_dir, f"{name} is missing: {what} holds qweight, qzeros and scales for every projection")
    path, entry = tables[name]
    if entry.dtype not in dtypes or entry.shape != shape:
        want = "/".join(dtypes)
        _refuse(path, f"{name} is {entry.dtype} {list(entry.shape)}; {what} needs {want} {list(shape)}")


def _refuse(path: Path, problem: str) -> NoReturn:
    raise LorafleetError(ErrorCode.INVALID_REQUEST, f"{path}: {problem}")
