"""The tensor table of a safetensors file, checked as strictly as the format allows, without torch.

A safetensors file is `[8-byte little-endian header length N][N bytes of JSON header][data]`. The
header maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (byte offsets
into the data section), plus an optional `"__metadata__"` of strings. Accepted here only when every
entry has exactly those fields with the right types, each tensor's byte span is its shape times its
dtype's size, and the spans tile the data section exactly: in order, no gap, no overlap, nothing
past the end or after the last tensor. So a truncated or padded file, an entry aliasing another's
bytes, or a header that is not a table never reaches a reader.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from shared.errors import ErrorCode, LorafleetError

MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 8
# bytes per element of every dtype the format defines (which of them an adapter may use is the caller's rule)
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str  # a key of DTYPE_SIZES
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section (after the header)
    end: int


def _invalid(file_name: str, message: str) -> LorafleetError:
    return LorafleetError(ErrorCode.INVALID_SAFETENSORS, f"{file_name}: {message}")


def header_length(prefix: bytes, file_size: int, file_name: str) -> int:
    """N from the file's first 8 bytes; raises unless the header fits the limit and the file."""
    if len(prefix) != 8:
        raise _invalid(file_name, "shorter than a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise _invalid(file_name, f"header of {length} bytes, over the limit of {MAX_HEADER_BYTES}")
    if 8 + length > file_size:
        raise _invalid(file_name, f"header of {length} bytes runs past the end of the {file_size}-byte file")
    return length


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    table = dict(pairs)
    if len(table) != len(pairs):
        raise ValueError("a name appears twice")
    return table


_DECODER = json.JSONDecoder(object_pairs_hook=_unique)


def parse_table(header: bytes, data_bytes: int, file_name: str) -> dict[str, TensorEntry]:
    """Tensor name → entry from the JSON `header`, for a data section of `data_bytes` bytes."""
    try:
        table = _DECODER.decode(header.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _invalid(file_name, f"the header is not JSON ({type(exc).__name__})") from exc
    if not isinstance(table, dict):
        raise _invalid(file_name, "the header is not a JSON object")
    metadata = table.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _invalid(file_name, "__metadata__ must map names to strings")
    entries = {name: _entry(name, value, file_name) for name, value in table.items()}
    end = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            problem = "overlaps the tensor before it" if entry.begin < end else f"leaves a gap at byte {end}"
            raise _invalid(file_name, f"{name!r} {problem}")
        end = entry.end
    if end != data_bytes:
        raise _invalid(file_name, f"the tensors take {end} bytes of data, the file holds {data_bytes} (truncated?)")
    return entries


def _entry(name: str, value: object, file_name: str) -> TensorEntry:
    if not isinstance(value, dict) or set(value) != _ENTRY_FIELDS:
        raise _invalid(file_name, f"{name!r} is not an object of dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _invalid(file_name, f"{name!r}: dtype {str(dtype)[:20]!r} is not a safetensors dtype")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise _invalid(file_name, f"{name!r}: shape must be a list of at most {MAX_DIMS} non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise _invalid(file_name, f"{name!r}: data_offsets must be two non-negative integers")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise _invalid(file_name, f"{name!r}: data_offsets span {end - begin} bytes, its shape and dtype need another")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
