"""A checkpoint's safetensors tables (headers only) and the bytes of one small tensor, without torch:
what the start-up checks of quantized checkpoints read before any weight is loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.errors import ErrorCode, LorafleetError
from shared.safetensors_table import TensorEntry, header_length, parse_table


def checkpoint_tables(model_dir: Path) -> dict[str, tuple[Path, TensorEntry]]:
    """Tensor name → (its file, its entry) over the checkpoint's safetensors files (the shards an
    index names, or the single file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [model_dir / "model.safetensors"]
    tables: dict[str, tuple[Path, TensorEntry]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                length = header_length(f.read(8), size, str(path))
                table = parse_table(f.read(length), size - 8 - length, str(path))
        except OSError as exc:
            raise LorafleetError(ErrorCode.INVALID_REQUEST, f"{path}: cannot be read: {exc.strerror}") from exc
        tables.update((name, (path, entry)) for name, entry in table.items())
    return tables


def tensor_bytes(path: Path, entry: TensorEntry) -> bytes:
    """The raw data of the tensor at `entry` of the safetensors file `path`."""
    with open(path, "rb") as f:
        length = header_length(f.read(8), os.fstat(f.fileno()).st_size, str(path))
        f.seek(8 + length + entry.begin)
        return f.read(entry.end - entry.begin)
