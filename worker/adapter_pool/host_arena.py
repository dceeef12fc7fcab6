"""The host tier's memory: the whole host budget as one buffer, allocated once when the pool starts
(on CUDA page-locked by one cudaHostRegister, on a helper thread, so start-up goes on beside it), and
carved into one block per host adapter. Disk reads land straight in their block; evicting an adapter
from the host tier gives its block back. Nothing is page-locked while serving: per-adapter pinned
buffers cost the first pass of a 1,000-adapter Zipf load 26 s of cudaHostAlloc (0.32× of
all-resident on an H100), and 7 s still when registered per buffer on 8 threads (0.59× on an H200;
docs/benchmarks.md, issue #27).

Why sections: an adapter is one contiguous block (one host-to-device copy, and its file's data used
in place), so a free list over the whole arena could fragment until no hole fits the adapter being
read, however much is free in total. The arena is cut into sections of one largest adapter each
(max rank on every projection: the section size the pool passes) and a block never straddles two.
The pool prefetches at most `sections` adapters and evicts every host entry outside that window, so
once it has, at most sections - 1 other adapters hold blocks: one section is empty and any adapter
fits. Within a section blocks are first-fit and freed holes merge with their neighbours; adapters of
one size (the common case) take each other's holes exactly.

`ArenaAllocator` is the bookkeeping (offsets only, torch-free, thread-safe: loader threads carve,
the engine thread frees); `HostArena` the buffer it carves.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import structlog
import torch

from shared.config import EngineConfig
from shared.model_info import ModelInfo
from worker.adapter_pool.host_adapter import max_adapter_bytes

log = structlog.get_logger(__name__)

# Default host budget, in GPU pools' worth of bytes (max_loras largest adapters), when the config leaves it open.
_DEFAULT_HOST_ADAPTERS_PER_SLOT = 2


def host_budget_bytes(info: ModelInfo, dtype: torch.dtype, config: EngineConfig) -> int:
    """The host tier's bytes, the arena's size (host memory, page-locked on CUDA; the memory plan
    reports it): config.adapter_host_cache_gb, else room for
    _DEFAULT_HOST_ADAPTERS_PER_SLOT max-rank adapters per device slot. Raises ValueError for a tier
    smaller than max_loras max-rank adapters."""
    largest = max_adapter_bytes(info, max_rank=config.max_lora_rank, dtype=dtype)
    needed = config.max_loras * largest
    if config.adapter_host_cache_gb is None:
        return _DEFAULT_HOST_ADAPTERS_PER_SLOT * needed
    budget = int(config.adapter_host_cache_gb * (1 << 30))
    if budget < needed:
        raise ValueError(
            f"adapter_host_cache_gb={config.adapter_host_cache_gb} holds fewer adapters than max_loras="
            f"{config.max_loras}: at max_lora_rank={config.max_lora_rank} it needs >= {needed / (1 << 30):.2f}"
        )
    return budget


# Every block starts on this many bytes (any dtype's view of it is aligned; DMA reads whole lines).
ALIGNMENT = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class ArenaFull(Exception):
    """No hole of `nbytes` in the arena now (more may come free): the pool evicts for it on the
    engine thread and reads the adapter again into the block it carved."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"no room for {nbytes} bytes in the host arena")
        self.nbytes = nbytes


class ArenaTooSmall(ValueError):
    """A block larger than a section: it can never fit, whatever is evicted."""


class ArenaAllocator:
    def __init__(self, size: int, section_bytes: int) -> None:
        """`size` bytes cut into sections of `section_bytes`, the last one shorter when they do not
        divide it; each whole section is padded up to ALIGNMENT (`self.size` counts the padding)."""
        if size < 1 or section_bytes < 1:
            raise ValueError("an arena needs size >= 1 and section_bytes >= 1")
        whole, rest = divmod(size, section_bytes)
        self.section_bytes = _aligned(section_bytes) if whole else size
        self.size = whole * self.section_bytes + rest
        # per section, its holes as sorted [start, end) offsets
        self._holes: list[list[tuple[int, int]]] = [
            [(start, min(start + self.section_bytes, size))] for start in range(0, size, self.section_bytes)
        ]
        self._blocks: dict[int, int] = {}  # offset → aligned size
        self._lock = threading.Lock()
        self.used_bytes = 0

    @property
    def sections(self) -> int:
        return len(self._holes)

    def carve(self, nbytes: int) -> int | None:
        """The offset of a new block of `nbytes` (first fit, in address order); None when no hole
        holds it now. Raises ArenaTooSmall when no section could ever hold it."""
        size = _aligned(max(nbytes, 1))
        if size > min(self.section_bytes, _aligned(self.size)):
            raise ArenaTooSmall(
                f"an adapter of {nbytes} bytes does not fit in the host arena ({self.size} bytes, "
                f"--adapter-host-cache-gb) cut into sections of {self.section_bytes} bytes (one adapter of "
                "--max-lora-rank on every projection): raise --adapter-host-cache-gb or --max-lora-rank"
            )
        with self._lock:
            for holes in self._holes:
                for index, (start, end) in enumerate(holes):
                    if end - start >= size:
                        if end - start == size:
                            del holes[index]
                        else:
                            holes[index] = (start + size, end)
                        self._blocks[start] = size
                        self.used_bytes += size
                        return start
        return None

    def free(self, offset: int) -> None:
        """Give back the block at `offset`; it merges with the holes beside it."""
        with self._lock:
            size = self._blocks.pop(offset)
            self.used_bytes -= size
            holes = self._holes[self.section_of(offset)]
            start, end = offset, offset + size
            index = bisect.bisect(holes, (start, end))
            if index < len(holes) and holes[index][0] == end:  # the hole after it
                end = holes.pop(index)[1]
            if index > 0 and holes[index - 1][1] == start:  # the hole before it
                start = holes.pop(index - 1)[0]
                index -= 1
            holes.insert(index, (start, end))

    def section_of(self, offset: int) -> int:
        return offset // self.section_bytes

    def holes(self) -> list[tuple[int, int]]:
        """Every hole, [start, end) in address order."""
        with self._lock:
            return [hole for holes in self._holes for hole in holes]

    def bookkeeping_size(self) -> int:
        """Blocks carved and not given back (the holes need no count: freed ones merge, so there are
        at most blocks + sections of them)."""
        with self._lock:
            return len(self._blocks)


class HostArena:
    def __init__(self, size: int, section_bytes: int, *, page_locked: bool) -> None:
        """`size` bytes (host memory, page-locked when `page_locked`) allocated on a helper thread
        from here on; the first carve waits for it."""
        self.allocator = ArenaAllocator(size, section_bytes)
        self.page_locked = page_locked
        self.setup_seconds = 0.0  # allocating (and page-locking) the buffer, once it is done
        self._buffer: Future[torch.Tensor] = Future()
        self._unregister: Callable[[], None] = lambda: None
        threading.Thread(target=self._allocate, name="adapter-host-arena", daemon=True).start()

    @property
    def buffer(self) -> torch.Tensor:
        """The whole arena, uint8 [size] (waits for its allocation)."""
        return self._buffer.result()

    def carve(self, nbytes: int) -> torch.Tensor | None:
        """A new block, uint8 [nbytes]; None when no hole holds it now (ArenaTooSmall: never)."""
        offset = self.allocator.carve(nbytes)
        return None if offset is None else self.buffer[offset : offset + nbytes]

    def free(self, block: torch.Tensor) -> None:
        """Give back a carved block (or any dtype's view of it, from its start)."""
        self.allocator.free(self._offset(block))

    def section_of(self, block: torch.Tensor) -> int:
        return self.allocator.section_of(self._offset(block))

    def close(self) -> None:
        """Give the page-locking back (once; nothing may copy from the arena any more): the memory
        itself goes with the last block still held."""
        self._buffer.exception()  # the allocation done, or failed
        self._unregister()

    def _offset(self, block: torch.Tensor) -> int:
        offset = block.data_ptr() - self.buffer.data_ptr()
        if not 0 <= offset < self.allocator.size:
            raise ValueError("the tensor is not a block of this arena")
        return offset

    def _allocate(self) -> None:
        started = time.perf_counter()
        try:
            # zeroing touches every page on torch's threads, so page-locking finds them in memory
            buffer = torch.zeros(self.allocator.size, dtype=torch.uint8)
            if self.page_locked:
                cudart = torch.cuda.cudart()
                torch.cuda.check_error(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
                # unregistered on close, or when the arena goes: blocks still held elsewhere turn
                # pageable, not invalid
                self._unregister = weakref.finalize(self, _unregister, cudart, buffer.data_ptr())
        except BaseException as exc:
            log.exception("adapter_host_arena_failed", gb=round(self.allocator.size / 1e9, 2))
            self._buffer.set_exception(exc)
            return
        self.setup_seconds = time.perf_counter() - started
        self._buffer.set_result(buffer)
        log.info(
            "adapter_host_arena",
            gb=round(self.allocator.size / 1e9, 2),
            sections=self.allocator.sections,
            page_locked=self.page_locked,
            seconds=round(self.setup_seconds, 3),
        )


def _unregister(cudart: object, pointer: int) -> None:
    cudart.cudaHostUnregister(pointer)  # type: ignore[attr-defined]


class Carving:
    """The blocks one adapter read takes from an arena (`take`, a host_adapter.BufferSource), so that
    a read that fails, or that ends with a block it did not keep, gives them back. `granted`: a block
    the pool carved for this read (after evicting for it), used for a request of its exact size."""

    def __init__(self, arena: HostArena, granted: torch.Tensor | None = None) -> None:
        self._arena = arena
        self._granted = granted
        self._taken: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A block of `nbytes`. Raises ArenaFull when the arena has no room for it now."""
        if self._granted is not None and self._granted.numel() == nbytes:
            block, self._granted = self._granted, None
        else:
            block = self._arena.carve(nbytes)
            if block is None:
                raise ArenaFull(nbytes)
        self._taken.append(block)
        return block

    def keep(self, kept: torch.Tensor | None) -> None:
        """Give back every block but `kept`'s (None: all of them), and the grant if it went unused."""
        unused = [block for block in self._taken if kept is None or block.data_ptr() != kept.data_ptr()]
        if self._granted is not None:
            unused.append(self._granted)
        for block in unused:
            self._arena.free(block)
        self._taken, self._granted = [], None
