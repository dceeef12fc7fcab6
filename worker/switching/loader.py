"""Checkpoints into host memory and from there onto the device.

Cold: each safetensors file's data is read with `readinto` straight into host buffers, one per
segment of whole tensors (~256 MB), and the tensors are views into them: no extra host copy, and the
buffers are what the H2D copies read from. Where CUDA is present each segment is page-locked
(cudaHostRegister, exact size) on a helper thread while the next one is read, so pinning costs no
time of its own; torch's pinned allocator would round each buffer up to a power of two (up to twice
the memory) and pins at a few GB/s before the first byte is read.

Warm: the copies go tensor by tensor (in pieces, weights.COPY_CHUNK_BYTES) on a side CUDA stream, so
the model being served keeps its own stream, and the caller waits only for that side stream.
"""

from __future__ import annotations

import json
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import structlog
import torch

from shared.config import EngineConfig
from shared.model_info import ModelInfo
from worker.model.model import CausalLM, model_dtype
from worker.model.weights import checkpoint_files, paced_copies
from worker.switching.checkpoint_cache import HostWeights

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
_SEGMENT_BYTES = 256 << 20  # host buffers hold whole tensors, about this many bytes each
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


def _check_entry(entry: dict, name: str, path: Path, data_bytes: int) -> torch.dtype:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']!r}")
    start, end = entry["data_offsets"]
    count = 1
    for dim in entry["shape"]:
        count *= dim
    if not 0 <= start <= end <= data_bytes or end - start != count * torch.empty((), dtype=dtype).element_size():
        raise ValueError(f"{path}: tensor {name!r} has data offsets outside the file or of the wrong size")
    return dtype


def _segments(header: dict) -> list[list[tuple[str, dict]]]:
    """The tensors in file order, grouped into runs of about _SEGMENT_BYTES (a larger tensor alone)."""
    segments: list[list[tuple[str, dict]]] = [[]]
    size = 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
        if segments[-1] and size + nbytes > _SEGMENT_BYTES:
            segments.append([])
            size = 0
        segments[-1].append((name, entry))
        size += nbytes
    return [segment for segment in segments if segment]


def _view(buffer: torch.Tensor, base: int, entry: dict, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `entry` describes, as a view of `buffer` (uint8, the file's data from offset `base`)."""
    start, end = entry["data_offsets"]
    raw = buffer[start - base : end - base]
    if (start - base) % raw.new_empty((), dtype=dtype).element_size():
        raw = raw.clone()  # a view must be aligned to its element size; safetensors writers align, but not all
    return raw.view(dtype).reshape(tuple(entry["shape"]))


class PageLock:
    """Page-locks a host buffer for the CUDA driver, so copies from it are asynchronous DMA, and
    unlocks it when dropped; holds the buffer meanwhile."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))

    def __del__(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())


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


def _read_into(f, buffer: torch.Tensor, path: Path, progress: _Progress) -> None:
    view = memoryview(buffer.numpy())
    position = 0
    while position < len(view):
        read = f.readinto(view[position : position + _READ_CHUNK_BYTES])
        if not read:
            raise ValueError(f"{path}: file ended {len(view) - position} bytes early")
        position += read
        progress.advance(read)


def read_to_host(model: str, model_dir: Path, *, pin: bool) -> HostWeights:
    """Read every safetensors file of the checkpoint into host buffers (page-locked if `pin`); the
    tensors are views of them under their checkpoint names. Nothing is unpickled: safetensors only."""
    files = checkpoint_files(model_dir)
    progress = _Progress(model, sum(path.stat().st_size for path in files))
    tensors: dict[str, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    locks: list[Future] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="page-lock") as locker:
        for path in files:
            with path.open("rb", buffering=0) as f:
                header, data_start = _read_header(f, path)
                data_bytes = path.stat().st_size - data_start
                for segment in _segments(header):
                    dtypes = [_check_entry(entry, name, path, data_bytes) for name, entry in segment]
                    base, end = segment[0][1]["data_offsets"][0], segment[-1][1]["data_offsets"][1]
                    buffer = torch.empty(end - base, dtype=torch.uint8)
                    f.seek(data_start + base)
                    _read_into(f, buffer, path, progress)
                    if pin:  # locked while the next segment is read
                        locks.append(locker.submit(PageLock, buffer))
                    buffers.append(buffer)
                    for (name, entry), dtype in zip(segment, dtypes, strict=True):
                        if name in tensors:
                            raise ValueError(f"{model_dir}: tensor {name!r} appears in two shards")
                        tensors[name] = _view(buffer, base, entry, dtype)
        page_locks = tuple(lock.result() for lock in locks)
    nbytes = sum(buffer.numel() for buffer in buffers)
    return HostWeights(model=model, tensors=tensors, nbytes=nbytes, pinned=pin, keepalive=page_locks)


def new_model(info: ModelInfo, config: EngineConfig) -> CausalLM:
    """`info`'s model on config.device with LoRA slots for config.max_loras adapters of
    config.max_lora_rank, its weights uninitialised until `copy_to_model` fills them."""
    return CausalLM(
        info,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        dtype=model_dtype(config.dtype, info, config.device),
        device=config.device,
    )


def copy_to_model(model: CausalLM, host: HostWeights, stream: torch.cuda.Stream | None) -> None:
    """Fill `model`'s parameters from `host`. On CUDA the copies are queued on `stream` (a side
    stream: the serving model's kernels on the default stream go on meanwhile), paced so that the
    serving model's own small copies are never stuck behind the whole model, and this returns once
    they are done, so the weights may then be used from any stream."""
    if stream is None:
        model.load_tensors(host.tensors.items(), source=host.model)
        return
    with torch.cuda.stream(stream), paced_copies():
        model.load_tensors(host.tensors.items(), source=host.model)
    stream.synchronize()
