"""The adapter pool: every adapter a request names is brought to the device before the request is
admitted, through three tiers, without the engine step ever waiting on a disk.

    disk (PEFT dirs) ──loader threads──► pinned host cache ──side CUDA stream──► GPU pages
                     read, hash, validate,   (host_tier.py, in      (slot_writer.py)     (gpu_slots.py)
                     pack (host_adapter.py)   host_arena.py's
                                              blocks)

`request(ref)` is called for every request the engine accepts (the worker hands over every job it
has read at once), so the pool sees the whole backlog. Each `poll()` (once per engine step) moves
adapters one tier up: it collects finished disk reads into the host cache, starts copies into GPU
pages for adapters already on the host, and marks them READY once their copy has landed. Only the first
adapters waiting, in arrival order, as many as the host budget holds at their largest, are
prefetched (the prefetch window, never fewer than max_loras), so a backlog of a thousand adapters
never thrashes the tiers. Copies to the device start in that order too: an adapter whose pages
cannot be found yet holds back those behind it, so a high-rank adapter is not starved by small ones.
The scheduler admits a request only when its adapter is READY; others run meanwhile. A load that
fails is reported by `poll()` and fails only the requests naming that adapter.

Eviction (the policy in eviction.py ranks; the tiers below say what is evictable): GPU pages are
given up only by an adapter no running or waiting request names; a host entry only by one outside
the prefetch window. The GPU pool is max_loras adapters of max_lora_rank, in pages (more adapters of
lower rank fit); the host budget holds at least that many bytes (checked at start-up), and the
window is sized to what it holds, so the window always fits.

The host tier's bytes are one arena, allocated (page-locked on CUDA) once at start and carved per
adapter: a loader thread carves its adapter's block when the file's header gives its size and reads
the data straight into it. A read that finds no room ends there (ArenaFull); `poll()` then evicts
host entries outside the window for it, carves the block, and reads the adapter again into it (the
window's adapters always fit: host_arena.py says why). A host entry whose copy to the device is in
flight is never evicted: its block is what the copy reads.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Protocol

import structlog
import torch

from shared.adapter_digest import HASH_THREADS
from shared.config import EngineConfig
from shared.errors import ErrorCode, LorafleetError
from shared.schema import AdapterRef
from worker.adapter_pool.eviction import make_policy
from worker.adapter_pool.gpu_slots import GpuSlots
from worker.adapter_pool.host_adapter import HostAdapter, max_adapter_bytes
from worker.adapter_pool.host_arena import ArenaFull, ArenaTooSmall, Carving, HostArena, host_budget_bytes
from worker.adapter_pool.host_tier import HostTier
from worker.adapter_pool.rank_adapter import read_for_model
from worker.adapter_pool.slot_writer import SlotWriter, Upload
from worker.metrics import AdapterMetrics, AdapterTier
from worker.model.model import CausalLM

log = structlog.get_logger(__name__)

# Disk reads in parallel: reading and hashing release the GIL, so a few threads overlap well.
_LOADER_THREADS = 4


# The loads' piece hashes share HASH_THREADS threads (shared/adapter_digest.py): enough to keep up
# with the disk, and however many loads run, the engine thread keeps the other cores.
class PoolMirror(Protocol):
    """Another process's copy of this pool's device pages, kept the same: a tensor-parallel rank 0's
    followers (worker/engine/step_channel.py)."""

    def reading(self, ref: AdapterRef) -> None:
        """The pool started reading `ref` from disk."""

    def written(self, ref: AdapterRef, pages: tuple[int, ...]) -> None:
        """The pool queued `ref` into `pages` (its own, in rank order)."""


@dataclass(frozen=True, slots=True)
class LoadFailure:
    uid: str
    message: str


@dataclass(slots=True)
class _Read:
    future: Future[tuple[HostAdapter, float]]  # (adapter, seconds the read took)


@dataclass(slots=True)
class _Copy:
    upload: Upload
    started: float  # perf_counter


class AdapterPool:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        adapter_root: Path | None,
        metrics: AdapterMetrics,
        mirror: PoolMirror | None = None,
    ) -> None:
        """`mirror`: told of every disk read and every write into pages this pool starts (a
        tensor-parallel rank 0's followers, which read their parts and write them into the same pages)."""
        self._mirror = mirror
        self._model = model
        self._config = config
        self._adapter_root = adapter_root
        self._metrics = metrics
        largest = max_adapter_bytes(model.info, max_rank=config.max_lora_rank, dtype=model.dtype)
        budget = host_budget_bytes(model.info, model.dtype, config)
        self.gpu = GpuSlots(model.num_pages, make_policy(config.adapter_eviction))
        self._pages_for_rank = model.pages_for_rank
        self._writer = SlotWriter(model)
        # sections of one largest adapter: the window's adapters always find one empty (host_arena.py)
        self.arena = HostArena(budget, largest, page_locked=self._writer.device.type == "cuda")
        self.host: HostTier[HostAdapter] = HostTier(
            self.arena.allocator.size,  # every entry holds a block of it: the tier never evicts for bytes
            make_policy(config.adapter_eviction),
            released=lambda adapter: self.arena.free(adapter.buffer),
        )
        self._window = budget // largest  # adapters prefetched ahead: >= max_loras, and sure to fit the host
        self._executor = ThreadPoolExecutor(_LOADER_THREADS, thread_name_prefix="adapter-load")
        self._hasher = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="adapter-hash")
        self._demand: Counter[str] = Counter()  # uid → unfinished requests naming it
        self._refs: dict[str, AdapterRef] = {}  # for every uid with demand
        self._pending: dict[str, None] = {}  # uids with demand not READY on the device, in arrival order
        self._reads: dict[str, _Read] = {}
        self._copies: dict[str, _Copy] = {}
        # uid → event after the last step launched with it (CUDA): uploads into its pages wait for it
        self._last_reads: dict[str, torch.cuda.Event] = {}
        # (gpu uids, host uids) as of the last poll: read by the worker's heartbeat from another thread
        self.resident: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    # -- requests (engine thread) -----------------------------------------------------------------

    def request(self, ref: AdapterRef) -> None:
        """A request naming `ref` was accepted: bring its adapter up unless it is on the device."""
        uid = ref.uid
        self._demand[uid] += 1
        self._refs.setdefault(uid, ref)
        if self.gpu.holds(uid):
            self._metrics.hit(AdapterTier.GPU)
            return
        self._metrics.miss(AdapterTier.GPU)
        if uid in self._pending:
            return
        if uid in self.host:
            self._metrics.hit(AdapterTier.CPU)
        else:
            self._metrics.miss(AdapterTier.CPU)
        self._pending[uid] = None

    def preload(self, refs: Sequence[AdapterRef]) -> int:
        """Read `refs` from disk into the host tier before serving starts (never while the engine
        thread steps: call it before), in parallel, in order, as many as the tier holds, with a log
        line each. A read that fails is logged and skipped. Returns how many are now on the host."""
        reads = [(ref, self._executor.submit(self._read, ref)) for ref in refs if ref.uid not in self.host]
        if self._mirror is not None:
            for ref, _ in reads:
                self._mirror.reading(ref)
        preloaded = len(refs) - len(reads)
        position = 0
        while position < len(reads):
            ref, read = reads[position]
            try:
                try:
                    adapter, seconds = read.result()
                except ArenaFull:
                    adapter, seconds = self._read_alone(reads, position)
            except ArenaFull:
                log.warning("adapter_preload_stopped", reason="the host cache is full", preloaded=preloaded)
                break
            except Exception as exc:
                message = exc.message if isinstance(exc, LorafleetError) else f"{type(exc).__name__}: {exc}"
                log.warning("adapter_preload_failed", adapter=ref.uid, error=message)
                position += 1
                continue
            self.host.put(adapter.uid, adapter, evictable=lambda _: False)
            self._metrics.loaded(AdapterTier.DISK, seconds)
            preloaded += 1
            position += 1
            log.info(
                "adapter_preloaded",
                adapter=adapter.uid,
                done=position,
                total=len(reads),
                mb=round(adapter.nbytes / 1e6, 1),
                seconds=round(seconds, 3),
            )
        self._give_back(reads[position + 1 :])  # after a full cache
        self.resident = (tuple(self.gpu.resident), tuple(self.host.resident))
        return preloaded

    def _read_alone(self, reads: list[tuple[AdapterRef, Future]], position: int) -> tuple[HostAdapter, float]:
        """Read `reads[position]` again with nothing else carving: preload's reads carve in parallel, so a
        later one may have taken its room, which in order is its own. The later reads give their blocks
        back first and start again after it, unless it finds no room even so (ArenaFull: the cache is
        full, and they are dropped)."""
        later = [ref for ref, _ in reads[position + 1 :]]
        self._give_back(reads[position + 1 :])
        del reads[position + 1 :]
        try:
            read = self._read(reads[position][0])
        except ArenaFull:
            raise  # full in order: nothing after it is read
        except Exception:
            reads += [(ref, self._executor.submit(self._read, ref)) for ref in later]
            raise
        reads += [(ref, self._executor.submit(self._read, ref)) for ref in later]
        return read

    def _give_back(self, reads: Sequence[tuple[AdapterRef, Future]]) -> None:
        """Cancel the reads not started; give back the blocks of those that carved one."""
        for _, read in reads:
            if not read.cancel() and read.exception() is None:
                self.arena.free(read.result()[0].buffer)

    def drop(self, uid: str) -> None:
        """A request naming `uid` finished or left; the adapter stays cached but becomes evictable
        once no request names it."""
        self._demand[uid] -= 1
        if self._demand[uid] <= 0:
            del self._demand[uid]
            del self._refs[uid]
            self._pending.pop(uid, None)

    # -- moving adapters up the tiers (engine thread, once per step) --------------------------------

    def poll(self) -> list[LoadFailure]:
        """Advance every load without blocking. Returns the adapters whose load failed (their
        requests must fail); a later request for one of them tries again."""
        self._land_copies()
        failures = self._collect_reads(set(islice(self._pending, self._window)))
        # after the reads are collected: an adapter whose read just failed has left the queue, and
        # must not get a second read this poll (its requests are about to fail)
        window = list(islice(self._pending, self._window))
        pages_short = False
        for uid in window:
            if uid in self._copies or uid in self._reads or self.gpu.holds(uid):
                continue
            if uid not in self.host:
                self._start_read(uid)
                continue
            if pages_short:
                continue  # reads for the rest of the window still go on
            adapter = self.host.get(uid)
            reservation = self.gpu.reserve(
                uid, self._pages_for_rank(adapter.rank), evictable=lambda other: self._demand[other] == 0
            )
            if reservation is None:
                pages_short = True  # first waiting, first copied: later adapters wait for this one
                continue
            for _ in reservation.evicted_uids:
                self._metrics.evicted(AdapterTier.GPU)
            readers = [self._last_reads.pop(v) for v in reservation.evicted_uids if v in self._last_reads]
            try:
                upload = self._writer.write(reservation.pages, adapter, after=readers)
            except Exception as exc:  # a write failing fails this adapter, not the engine
                log.exception("adapter_upload_failed", adapter=uid)
                self.gpu.discard(uid)
                self._pending.pop(uid)
                failures.append(LoadFailure(uid, f"{type(exc).__name__}: {exc}"))
                continue
            self._copies[uid] = _Copy(upload, time.perf_counter())
            if self._mirror is not None:
                self._mirror.written(self._refs[uid], reservation.pages)
        self.resident = (tuple(self.gpu.resident), tuple(self.host.resident))
        self._metrics.set_resident(AdapterTier.GPU, len(self.resident[0]))
        self._metrics.set_resident(AdapterTier.CPU, len(self.resident[1]))
        return failures

    def launched(self, uids: Iterable[str]) -> None:
        """A step reading the pages of the adapters `uids` has just been launched: an upload into their
        pages, once they are evicted, must wait for it (and only for it and earlier steps)."""
        marker = self._writer.read_marker()
        if marker is not None:
            for uid in uids:
                self._last_reads[uid] = marker

    def wait(self, timeout_s: float) -> None:
        """Block until some load in flight finishes, at most `timeout_s`: for an engine with nothing
        it can run until an adapter arrives (instead of spinning on `poll`)."""
        if self._copies:
            next(iter(self._copies.values())).upload.wait()
        elif self._reads:
            wait_futures([r.future for r in self._reads.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def loads_in_flight(self) -> int:
        return len(self._reads) + len(self._copies)

    def close(self) -> None:
        """Stop the loader threads and give the arena's page-locking back, once the copies to the
        device in flight, which read it, have landed."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._hasher.shutdown(wait=False, cancel_futures=True)
        for copy in self._copies.values():
            copy.upload.wait()
        self.arena.close()

    def bookkeeping_size(self) -> int:
        """Entries across every map the pool keeps (a no-leak check: bounded by the tiers' sizes)."""
        return (
            self.gpu.bookkeeping_size()
            + self.host.bookkeeping_size()
            + len(self._demand)
            + len(self._refs)
            + len(self._pending)
            + len(self._reads)
            + len(self._copies)
            + len(self._last_reads)
            + self._writer.bookkeeping_size()
            + self.arena.allocator.bookkeeping_size()
        )

    def _land_copies(self) -> None:
        for uid, copy in list(self._copies.items()):
            if copy.upload.done():
                del self._copies[uid]
                self.gpu.mark_ready(uid)
                self._pending.pop(uid, None)
                self._metrics.loaded(AdapterTier.CPU, time.perf_counter() - copy.started)

    def _collect_reads(self, window: set[str]) -> list[LoadFailure]:
        failures = []
        for uid, read in list(self._reads.items()):
            if not read.future.done():
                continue
            del self._reads[uid]
            try:
                adapter, seconds = read.future.result()
            except ArenaFull as full:
                if uid in window:  # otherwise the window's next poll reads it again, if it comes back
                    self._read_into_room(uid, full.nbytes, window)
                continue
            except Exception as exc:
                message = exc.message if isinstance(exc, LorafleetError) else f"{type(exc).__name__}: {exc}"
                log.warning("adapter_load_failed", adapter=uid, error=message)
                if self._pending.pop(uid, "absent") is None:
                    failures.append(LoadFailure(uid, message))
                continue
            self._metrics.loaded(AdapterTier.DISK, seconds)
            if uid not in window:
                self.arena.free(adapter.buffer)  # nobody waits for it any more: its block goes to the window
                continue
            self.host.put(uid, adapter, evictable=lambda _: False)  # its block is in the arena: it fits
        return failures

    def _read_into_room(self, uid: str, nbytes: int, window: set[str]) -> None:
        """Evict host entries outside `window` (and not being copied to the device: their blocks are
        read by the copy) until the arena can carve `nbytes`, then read `uid` again into that block.
        With nothing left to evict (reads and copies of adapters that left the window still hold
        blocks) it is read again from the start, until they are done."""
        block, evicted = self.host.evict_until(
            lambda: self.arena.carve(nbytes),
            evictable=lambda other: other not in window and other not in self._copies,
            group=lambda adapter: self.arena.section_of(adapter.buffer),
        )
        for _ in evicted:
            self._metrics.evicted(AdapterTier.CPU)
        if block is not None:
            self._start_read(uid, block)

    def _start_read(self, uid: str, granted: torch.Tensor | None = None) -> None:
        self._reads[uid] = _Read(self._executor.submit(self._read, self._refs[uid], granted))
        if self._mirror is not None:
            self._mirror.reading(self._refs[uid])

    def _read(self, ref: AdapterRef, granted: torch.Tensor | None = None) -> tuple[HostAdapter, float]:
        """Disk → a block of the host arena (`granted`, carved for it by the engine thread, or one it
        carves), on a loader thread. Raises ArenaFull, having read only the file's header, when the
        arena has no room for it now."""
        started = time.perf_counter()
        carving = Carving(self.arena, granted)
        try:
            if self._adapter_root is None:
                raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, "this engine has no adapter root")
            adapter = read_for_model(
                ref, self._model, self._config, self._adapter_root, take=carving.take, hasher=self._hasher
            )
        except ArenaTooSmall as exc:  # what the rank check let through cannot be: still, only this load fails
            carving.keep(None)
            raise LorafleetError(ErrorCode.ADAPTER_TOO_LARGE, str(exc)) from exc
        except BaseException:
            carving.keep(None)
            raise
        carving.keep(adapter.buffer)
        return adapter, time.perf_counter() - started
