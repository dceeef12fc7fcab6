"""A tensor-parallel follower's host copies of adapters: its parts of the adapters rank 0's pool
reads, read on a loader thread as soon as rank 0 starts reading them (so a first load costs the
follower no more wait than rank 0's own read), and kept least-recently-used out within the host
budget rank 0's tier has, so that an adapter written into the device again after an eviction finds
its part here, as rank 0 finds its own in its host tier, and the step that follows waits for no disk.
Its parts are page-locked per adapter (`fresh_buffers`), not carved from a host arena as rank 0's
are: an entry here is evicted while its copy may still be in flight, which a reused block could not be.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from shared.config import EngineConfig
from shared.schema import AdapterRef
from worker.adapter_pool.eviction import make_policy
from worker.adapter_pool.host_adapter import HostAdapter, fresh_buffers
from worker.adapter_pool.host_arena import host_budget_bytes
from worker.adapter_pool.host_tier import HostTier
from worker.adapter_pool.rank_adapter import read_for_model
from worker.model.model import CausalLM

_LOADER_THREADS = 2


class FollowerAdapters:
    def __init__(self, model: CausalLM, config: EngineConfig, adapter_root: Path | None, *, pin: bool) -> None:
        self._model = model
        self._config = config
        self._adapter_root = adapter_root
        self._pin = pin
        self._tier: HostTier[HostAdapter] = HostTier(
            host_budget_bytes(model.info, model.dtype, config), make_policy("lru")
        )
        self._reads: dict[str, Future[HostAdapter]] = {}
        self._executor = ThreadPoolExecutor(_LOADER_THREADS, thread_name_prefix="adapter-read-ahead")

    def read_ahead(self, ref: AdapterRef) -> None:
        """Start reading `ref`'s part unless it is here or on its way."""
        if ref.uid not in self._tier and ref.uid not in self._reads:
            self._reads[ref.uid] = self._executor.submit(self._read, ref)

    def take(self, ref: AdapterRef) -> HostAdapter:
        """`ref`'s part, from the host copies, the read under way, or a read now. A read that fails
        raises (rank 0 read the same file: this rank can no longer follow it)."""
        adapter = self._tier.get(ref.uid)
        if adapter is not None:
            return adapter
        read = self._reads.pop(ref.uid, None)
        adapter = read.result() if read is not None else self._read(ref)
        # an upload in flight keeps its own reference to the buffer, so every copy here may go
        self._tier.put(ref.uid, adapter, evictable=lambda _uid: True)
        return adapter

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _read(self, ref: AdapterRef) -> HostAdapter:
        if self._adapter_root is None:
            raise RuntimeError("rank 0 loaded an adapter, and this follower has no adapter root")
        return read_for_model(ref, self._model, self._config, self._adapter_root, take=fresh_buffers(pin=self._pin))
