"""Checkpoints into host memory and from there onto the device.

Cold: each safetensors file's data section is read with `readinto` straight into one (pinned, where
CUDA is present) host buffer, and the tensors are views into it: no extra host copy, and the buffer
is what the H2D copies read from. Warm: the copies go tensor by tensor on a side CUDA stream, so
the model being served keeps its own stream, and the caller waits only for that side stream.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from pathlib import Path

import structlog
import torch

from worker.engine.model import CausalLM
from worker.engine.weights import checkpoint_files
from worker.models.host_cache import HostWeights

log = structlog.get_logger(__name__)

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_READ_CHUNK_BYTES = 64 << 20
_PROGRESS_MIN_BYTES = 1 << 30  # checkpoints at least this large log their read progress
_PROGRESS_STEPS = 10


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's safetensors files: what a cold load reads and a warm one copies."""
    return sum(path.stat().st_size for path in checkpoint_files(model_dir))


def _read_header(f, path: Path) -> tuple[dict, int]:
    """(tensor entries, offset of the data section) of an open safetensors file."""
    (size,) = struct.unpack("<Q", f.read(8))
    if size > _MAX_HEADER_BYTES:
        raise ValueError(f"{path}: safetensors header of {size} bytes is over the {_MAX_HEADER_BYTES} limit")
    header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _tensor_view(buffer: torch.Tensor, entry: dict, name: str, path: Path) -> torch.Tensor:
    """The tensor `entry` describes, as a view of the file's data `buffer` (uint8 [data bytes])."""
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']!r}")
    start, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    if not 0 <= start <= end <= buffer.numel() or end - start != count * itemsize:
        raise ValueError(f"{path}: tensor {name!r} has data offsets outside the file or of the wrong size")
    raw = buffer[start:end]
    if start % itemsize:
        raw = raw.clone()  # a view must be aligned to its element size; safetensors writers align, but not all
    return raw.view(dtype).reshape(shape)


class _Progress:
    """A log line every tenth of a large checkpoint, with the read bandwidth so far."""

    def __init__(self, model: str, total: int) -> None:
        self.model, self.total, self.done = model, total, 0
        self.started = time.perf_counter()
        self._next = total // _PROGRESS_STEPS if total >= _PROGRESS_MIN_BYTES else None

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._next is None or self.done < self._next:
            return
        self._next += self.total // _PROGRESS_STEPS
        elapsed = time.perf_counter() - self.started
        log.info(
            "model_read_progress",
            model=self.model,
            percent=round(100 * self.done / self.total),
            read_gb=round(self.done / 1e9, 2),
            total_gb=round(self.total / 1e9, 2),
            gb_per_s=round(self.done / 1e9 / max(elapsed, 1e-9), 2),
        )


def read_to_host(model: str, model_dir: Path, *, pin: bool) -> HostWeights:
    """Read every safetensors file of the checkpoint into host buffers (pinned if `pin`); the tensors
    are views of them under their checkpoint names. Nothing is unpickled: safetensors only."""
    files = checkpoint_files(model_dir)
    progress = _Progress(model, sum(path.stat().st_size for path in files))
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    for path in files:
        with path.open("rb", buffering=0) as f:
            header, data_start = _read_header(f, path)
            data_bytes = path.stat().st_size - data_start
            buffer = torch.empty(data_bytes, dtype=torch.uint8, pin_memory=pin)
            view = memoryview(buffer.numpy())
            f.seek(data_start)
            position = 0
            while position < data_bytes:
                read = f.readinto(view[position : position + _READ_CHUNK_BYTES])
                if not read:
                    raise ValueError(f"{path}: file ended {data_bytes - position} bytes early")
                position += read
                progress.advance(read)
        for name, entry in header.items():
            if name in tensors:
                raise ValueError(f"{model_dir}: tensor {name!r} appears in two shards")
            tensors[name] = _tensor_view(buffer, entry, name, path)
        nbytes += data_bytes
    return HostWeights(model=model, tensors=tensors, nbytes=nbytes, pinned=pin)


def copy_to_model(model: CausalLM, host: HostWeights, stream: torch.cuda.Stream | None) -> None:
    """Fill `model`'s parameters from `host`. On CUDA the copies are queued on `stream` (a side
    stream: the serving model's kernels on the default stream go on meanwhile) and this returns once
    they are done, so the weights may then be used from any stream."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        model.load_tensors(host.tensors.items(), source=host.model)
    if stream is not None:
        stream.synchronize()
