"""A small per-process cache whose entries expire: what a gateway may remember between requests.

Hand-written rather than cachetools: the gateway also runs on the GPU machines, whose image carries
its few wheels by hand. Event-loop use only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """Up to `max_entries` values, each forgotten `ttl_s` seconds after it was stored (the oldest goes
    first when full). `get_or_load` lets concurrent misses of one key share a single load, so an entry
    expiring under load costs one lookup, not one per request in flight."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}  # insertion order = expiry order
        self._loads: dict[K, asyncio.Future[V | None]] = {}

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._entries[key]
            return None
        return entry[1]

    def put(self, key: K, value: V) -> None:
        self._entries.pop(key, None)
        if len(self._entries) >= self._max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (time.monotonic() + self._ttl_s, value)

    def clear(self) -> None:
        self._entries.clear()

    async def get_or_load(self, key: K, load: Callable[[], Awaitable[V | None]]) -> V | None:
        """The cached value, else `load()`'s (stored unless None; an exception is raised to every waiter
        and stores nothing)."""
        value = self.get(key)
        if value is not None:
            return value
        pending = self._loads.get(key)
        if pending is None:
            pending = asyncio.ensure_future(load())
            self._loads[key] = pending
            pending.add_done_callback(lambda done: self._settle(key, done))
        return await asyncio.shield(pending)  # one waiter going away must not cancel the others' load

    def _settle(self, key: K, done: asyncio.Future[V | None]) -> None:
        del self._loads[key]
        if not done.cancelled() and done.exception() is None and done.result() is not None:
            self.put(key, done.result())
