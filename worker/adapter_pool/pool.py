"""The adapter pool: every adapter a request names is brought to the device before the request is
admitted, through three tiers, without the engine step ever waiting on a disk.

    disk (PEFT dirs) ──loader threads──► pinned host cache ──side CUDA stream──► GPU pages
                     read, hash, validate,   (host_tier.py,        (slot_writer.py)     (gpu_slots.py)
                     pack (host_adapter.py)   byte budget)

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
# Default host budget, in GPU pools' worth of bytes (max_loras largest adapters), when the config leaves it open.
_DEFAULT_HOST_ADAPTERS_PER_SLOT = 2


def host_budget_bytes(model: CausalLM, config: EngineConfig) -> int:
    """The pinned host tier's bytes: config.adapter_host_cache_gb, else room for
    _DEFAULT_HOST_ADAPTERS_PER_SLOT max-rank adapters per device slot. Raises ValueError for a tier
    smaller than max_loras max-rank adapters."""
    largest = max_adapter_bytes(model.info, max_rank=config.max_lora_rank, dtype=model.dtype)
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
        budget = host_budget_bytes(model, config)
        self.gpu = GpuSlots(model.num_pages, make_policy(config.adapter_eviction))
        self._pages_for_rank = model.pages_for_rank
        self.host: HostTier[HostAdapter] = HostTier(budget, make_policy(config.adapter_eviction))
        self._window = budget // largest  # adapters prefetched ahead: >= max_loras, and sure to fit the host
        self._writer = SlotWriter(model)
        self._pin = self._writer.device.type == "cuda"
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
        for index, (ref, read) in enumerate(reads, 1):
            try:
                adapter, seconds = read.result()
            except Exception as exc:
                message = exc.message if isinstance(exc, LorafleetError) else f"{type(exc).__name__}: {exc}"
                log.warning("adapter_preload_failed", adapter=ref.uid, error=message)
                continue
            if self.host.nbytes + adapter.nbytes > self.host.budget_bytes:
                log.warning("adapter_preload_stopped", reason="the host cache is full", preloaded=preloaded)
                break
            self.host.put(adapter.uid, adapter, evictable=lambda _: False)
            self._metrics.loaded(AdapterTier.DISK, seconds)
            preloaded += 1
            log.info(
                "adapter_preloaded",
                adapter=adapter.uid,
                done=index,
                total=len(reads),
                mb=round(adapter.nbytes / 1e6, 1),
                seconds=round(seconds, 3),
            )
        for _, read in reads:
            read.cancel()  # after a full cache: those not started yet
        self.resident = (tuple(self.gpu.resident), tuple(self.host.resident))
        return preloaded

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
                self._reads[uid] = _Read(self._executor.submit(self._read, self._refs[uid]))
                if self._mirror is not None:
                    self._mirror.reading(self._refs[uid])
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
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._hasher.shutdown(wait=False, cancel_futures=True)

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
            except Exception as exc:
                message = exc.message if isinstance(exc, LorafleetError) else f"{type(exc).__name__}: {exc}"
                log.warning("adapter_load_failed", adapter=uid, error=message)
                if self._pending.pop(uid, "absent") is None:
                    failures.append(LoadFailure(uid, message))
                continue
            self._metrics.loaded(AdapterTier.DISK, seconds)
            if uid not in window:
                continue  # nobody waits for it any more, and only the window is sure to fit
            try:
                evicted = self.host.put(uid, adapter, evictable=lambda other: other not in window)
            except RuntimeError as exc:  # larger than the budget's sizing assumed: fail it, not the engine
                log.exception("adapter_host_cache_full", adapter=uid)
                self._pending.pop(uid, None)
                failures.append(LoadFailure(uid, str(exc)))
                continue
            for _ in evicted:
                self._metrics.evicted(AdapterTier.CPU)
        return failures

    def _read(self, ref: AdapterRef) -> tuple[HostAdapter, float]:
        """Disk → host, on a loader thread."""
        started = time.perf_counter()
        if self._adapter_root is None:
            raise LorafleetError(ErrorCode.ADAPTER_LOAD_FAILED, "this engine has no adapter root")
        adapter = read_for_model(ref, self._model, self._config, self._adapter_root, pin=self._pin, hasher=self._hasher)
        return adapter, time.perf_counter() - started
