"""Safetensors shards read at the disk's speed: the one way checkpoint bytes come off the disk.

Each file's header is parsed here (shared/safetensors_table.py, as strictly as adapters' are), and
its data section is read in segments of whole tensors (~SEGMENT_BYTES; a larger tensor alone) with
large reads, several in flight on a small thread pool (`os.preadv` releases the GIL), through
O_DIRECT where the filesystem allows it (no page-cache copy, no cache pollution by a checkpoint read
once; a file system that refuses it is read through the cache instead). Where the bytes land is the
caller's `SegmentBuffers`:

- `StagingRing`: a few buffers reused load after load, page-locked once when CUDA is present. The
  consumer queues its host-to-device copies of a segment's tensors on its current stream, an event
  is recorded when it moves on, and the buffer takes the segment `count` places later only once that
  event has passed: reads overlap the copies, and the host never holds the whole checkpoint.
- `KeptBuffers`: a fresh buffer per segment, kept (the warm tier's host copy), page-locked on a
  helper thread while the next segments are read.

A short read, a file whose size or mtime changes while it is read, or a disk error raises
CheckpointReadError naming the file: that load fails, nothing else.
"""

from __future__ import annotations

import abc
import errno
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from shared.safetensors_table import TensorEntry, header_length, parse_table

log = structlog.get_logger(__name__)

ALIGN = 4096  # O_DIRECT's offset, length and address alignment (a multiple of any logical block size)
SEGMENT_BYTES = 256 << 20  # tensors are grouped into reads of about this many bytes
CHUNK_BYTES = 16 << 20  # one read call; a segment's chunks are read in parallel
READ_THREADS = 4
_PROGRESS_MIN_BYTES = 1 << 30  # checkpoints at least this large log their read progress
_PROGRESS_STEPS = 10

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
}


class CheckpointReadError(OSError):
    """A checkpoint file could not be read whole and unchanged; the message names the file."""


class PageLock:
    """Page-locks a host buffer for the CUDA driver, so copies from it are asynchronous DMA, and
    unlocks it when dropped; holds the buffer meanwhile. Exact size, unlike torch's pinned allocator,
    which rounds a buffer up to a power of two."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))

    def __del__(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host buffer of `nbytes` (rounded up to ALIGN) whose address is ALIGN-aligned.

    The buffer is its storage's whole, not a slice of a larger one: torch's `is_pinned` asks the CUDA
    driver about a tensor's storage's first byte, which must be the first byte a PageLock registers,
    or page-locked buffers (and every tensor viewing them) read as pageable."""
    nbytes = -(-nbytes // ALIGN) * ALIGN
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[skip : skip + nbytes])  # a storage starting at the slice, keeping `raw` alive


class SegmentBuffers(abc.ABC):
    """Where the reader puts each segment: `buffer(k)` on a read thread before segment k's reads,
    `done(k)` on the consumer's thread once it has moved past segment k's tensors."""

    @abc.abstractmethod
    def reserve(self, sizes: Sequence[int]) -> None:
        """Before any read: the bytes of every segment's aligned read, in order."""

    @abc.abstractmethod
    def buffer(self, segment: int) -> torch.Tensor:
        """An ALIGN-aligned uint8 buffer of at least the segment's bytes, free to be written."""

    @abc.abstractmethod
    def done(self, segment: int) -> None:
        """The consumer has queued all its work on segment `segment`'s tensors."""


class StagingRing(SegmentBuffers):
    """`count` reused buffers (page-locked when `pin`), each as large as the largest segment seen:
    segment k reads into buffer k % count once the copies queued from its previous segment are done."""

    def __init__(self, *, pin: bool, count: int = 3) -> None:
        self.pin, self.count = pin, count
        self._buffers: list[torch.Tensor] = []
        self._locks: list[PageLock] = []
        self._released: list[torch.cuda.Event | None] = [None] * count

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers)

    def reserve(self, sizes: Sequence[int]) -> None:
        largest = max(sizes, default=0)
        if self._buffers and self._buffers[0].numel() >= largest:
            return
        self._settle()
        self._locks.clear()  # unlocked before the old buffers go
        self._buffers = [aligned_empty(max(largest, ALIGN)) for _ in range(self.count)]
        if self.pin:
            self._locks = [PageLock(buffer) for buffer in self._buffers]

    def buffer(self, segment: int) -> torch.Tensor:
        released = self._released[segment % self.count]
        if released is not None:
            released.synchronize()  # the copies out of its previous segment have landed
        return self._buffers[segment % self.count]

    def done(self, segment: int) -> None:
        if self.pin:
            event = torch.cuda.Event()
            event.record()  # on the consumer's current stream, after the copies it queued
            self._released[segment % self.count] = event

    def _settle(self) -> None:
        for event in self._released:
            if event is not None:
                event.synchronize()
        self._released = [None] * self.count


class KeptBuffers(SegmentBuffers):
    """A fresh buffer per segment, kept; page-locked on a helper thread after its reads when `pin`."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.buffers: list[torch.Tensor] = []
        self._sizes: Sequence[int] = ()
        self._locker = ThreadPoolExecutor(1, thread_name_prefix="page-lock") if pin else None
        self._locks: list[Future[PageLock]] = []

    def reserve(self, sizes: Sequence[int]) -> None:
        self._sizes = sizes
        self.buffers = [torch.empty(0, dtype=torch.uint8)] * len(sizes)

    def buffer(self, segment: int) -> torch.Tensor:
        self.buffers[segment] = aligned_empty(self._sizes[segment])
        return self.buffers[segment]

    def done(self, segment: int) -> None:
        if self._locker is not None:
            self._locks.append(self._locker.submit(PageLock, self.buffers[segment]))

    def page_locks(self) -> tuple[PageLock, ...]:
        """Wait for every buffer's lock (raises the first failure); the locks keep them page-locked."""
        if self._locker is None:
            return ()
        self._locker.shutdown(wait=True)
        return tuple(lock.result() for lock in self._locks)


@dataclass(frozen=True, slots=True)
class _Shard:
    path: Path
    fd: int  # buffered: the header, and fstat to notice a change
    data_fd: int  # O_DIRECT where the file system allows it, else `fd`
    direct: bool
    data_start: int  # file offset of the data section
    size: int
    mtime_ns: int
    table: dict[str, TensorEntry]

    def check_unchanged(self) -> None:
        stat = os.fstat(self.fd)
        if (stat.st_size, stat.st_mtime_ns) != (self.size, self.mtime_ns):
            raise CheckpointReadError(f"{self.path}: the file changed while it was read (size or mtime)")


@dataclass(frozen=True, slots=True)
class _Segment:
    shard: _Shard
    tensors: tuple[tuple[str, TensorEntry], ...]  # in file order
    start: int  # the aligned read: file bytes [start, start + nbytes)
    nbytes: int
    needed: int  # bytes from `start` the tensors need (the rest is alignment past the file's end)


def _open_shard(path: Path) -> _Shard:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stat = os.fstat(fd)
        prefix = os.pread(fd, 8, 0)
        length = header_length(prefix, stat.st_size, str(path))
        header = os.pread(fd, length, 8)
        if len(header) != length:
            raise CheckpointReadError(f"{path}: the file ended inside its header")
        table = parse_table(header, stat.st_size - 8 - length, str(path))
        data_fd = _direct_fd(path)
    except BaseException:
        os.close(fd)
        raise
    direct = data_fd is not None
    return _Shard(path, fd, data_fd if direct else fd, direct, 8 + length, stat.st_size, stat.st_mtime_ns, table)


def _direct_fd(path: Path) -> int | None:
    """A descriptor reading `path` with O_DIRECT, if its file system takes O_DIRECT reads; else None."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None
    try:  # some file systems open with O_DIRECT and refuse the reads
        os.preadv(fd, [memoryview(aligned_empty(ALIGN).numpy())], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.EINVAL:
            return None
        raise CheckpointReadError(f"{path}: read failed ({exc.strerror})") from exc
    return fd


def _segments(shard: _Shard) -> list[_Segment]:
    """The shard's tensors in file order, grouped into aligned reads of about SEGMENT_BYTES (a larger
    tensor alone)."""
    groups: list[list[tuple[str, TensorEntry]]] = [[]]
    for name, entry in sorted(shard.table.items(), key=lambda item: item[1].begin):
        if groups[-1] and entry.end - groups[-1][0][1].begin > SEGMENT_BYTES:
            groups.append([])
        groups[-1].append((name, entry))
    segments = []
    for group in filter(None, groups):
        first, last = shard.data_start + group[0][1].begin, shard.data_start + group[-1][1].end
        start = first // ALIGN * ALIGN
        nbytes = -(-(last - start) // ALIGN) * ALIGN
        segments.append(_Segment(shard, tuple(group), start, nbytes, last - start))
    return segments


def _read_chunk(segment: _Segment, buffer: torch.Tensor, begin: int, end: int) -> None:
    """File bytes [segment.start + begin, + end) into buffer[begin:end] (a read thread). Past
    `segment.needed` the bytes may be missing: the aligned read may run past the file's end."""
    shard = segment.shard
    view = memoryview(buffer.numpy())
    needed = min(end, segment.needed)
    done = begin
    while done < needed:
        offset = segment.start + done
        try:
            read = os.preadv(shard.data_fd, [view[done:end]], offset)
        except OSError as exc:
            raise CheckpointReadError(f"{shard.path}: read failed at byte {offset} ({exc.strerror})") from exc
        if read == 0 or (shard.direct and read % ALIGN and done + read < needed):
            raise CheckpointReadError(f"{shard.path}: the file ended {needed - done - read} bytes early")
        done += read


def _read_segment(
    coordinator: ThreadPoolExecutor, readers: ThreadPoolExecutor, segment: _Segment, buffers: SegmentBuffers, index: int
) -> Future[tuple[_Segment, torch.Tensor]]:
    """Start segment `index`'s reads: a coordinator thread takes its buffer (which may wait for the
    copies out of the buffer's previous segment) and fans the chunks out to the read threads."""

    def read() -> tuple[_Segment, torch.Tensor]:
        buffer = buffers.buffer(index)
        chunks = [
            readers.submit(_read_chunk, segment, buffer, begin, min(begin + CHUNK_BYTES, segment.nbytes))
            for begin in range(0, segment.nbytes, CHUNK_BYTES)
        ]
        for chunk in chunks:
            chunk.result()
        return segment, buffer

    return coordinator.submit(read)


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


def _view(buffer: torch.Tensor, offset: int, entry: TensorEntry) -> torch.Tensor:
    dtype = DTYPES[entry.dtype]
    raw = buffer[offset : offset + entry.end - entry.begin]
    if offset % dtype.itemsize:
        raw = raw.clone()  # a view must be aligned to its element size; safetensors writers align, but not all
    return raw.view(dtype).reshape(entry.shape)


def read_tensors(
    model: str, files: Sequence[Path], buffers: SegmentBuffers, *, window: int = 3
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of `files`, in file order, as views of `buffers`:
    a tensor may be read only by work queued (on the current CUDA stream, or done synchronously)
    before the next one is asked for. Up to `window` segments are read ahead (a StagingRing needs
    `window` <= its count). Close the iterator when stopping early (contextlib.closing): it waits for
    the reads in flight."""
    shards: list[_Shard] = []
    try:
        for path in files:
            shards.append(_open_shard(Path(path)))
        names: dict[str, Path] = {}
        for shard in shards:
            for name in shard.table:
                if names.setdefault(name, shard.path) != shard.path:
                    raise CheckpointReadError(f"{shard.path}: tensor {name!r} is also in {names[name]}")
        segments = [segment for shard in shards for segment in _segments(shard)]
        buffers.reserve([segment.nbytes for segment in segments])
        progress = _Progress(model, sum(segment.needed for segment in segments))
        coordinator = ThreadPoolExecutor(window, thread_name_prefix="checkpoint-segment")
        readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="checkpoint-read")
        reads = [
            _read_segment(coordinator, readers, segment, buffers, k) for k, segment in enumerate(segments[:window])
        ]
        in_hand = None  # a segment whose tensors were handed out and not yet released
        try:
            for index in range(len(segments)):
                segment, buffer = reads[index].result()
                segment.shard.check_unchanged()
                progress.advance(segment.needed)
                in_hand = index
                for name, entry in segment.tensors:
                    yield name, _view(buffer, segment.shard.data_start + entry.begin - segment.start, entry)
                in_hand = None
                buffers.done(index)
                if index + window < len(segments):
                    reads.append(_read_segment(coordinator, readers, segments[index + window], buffers, index + window))
        finally:
            if in_hand is not None:  # stopped early: its buffer is free only once what was queued from it is done
                buffers.done(in_hand)
            for read in reads:
                read.cancel()
            coordinator.shutdown(wait=True)  # no read may still write into a buffer once this returns
            readers.shutdown(wait=True)
    finally:
        for shard in shards:
            if shard.direct:
                os.close(shard.data_fd)
            os.close(shard.fd)
