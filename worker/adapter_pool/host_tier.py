"""The pinned-CPU tier: adapters already read from disk and packed for one copy to the device,
kept least-valuable-out within a byte budget (torch-free bookkeeping; entries only say `nbytes`).
The pool's entries live in blocks of its host arena (host_arena.py): `released` gives an entry's
block back whenever it leaves, and `evict_until` makes room for a block the arena cannot carve yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from worker.adapter_pool.eviction import EvictionPolicy


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=Sized)
Result = TypeVar("Result")


class HostTier(Generic[Entry]):
    def __init__(
        self, budget_bytes: int, policy: EvictionPolicy, released: Callable[[Entry], None] = lambda _: None
    ) -> None:
        """`released(entry)`: called as each entry leaves (evicted or removed)."""
        if budget_bytes < 1:
            raise ValueError("budget_bytes must be >= 1")
        self.budget_bytes = budget_bytes
        self._policy = policy
        self._released = released
        self._entries: dict[str, Entry] = {}
        self.nbytes = 0

    def __contains__(self, uid: str) -> bool:
        return uid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def resident(self) -> list[str]:
        return list(self._entries)

    def get(self, uid: str) -> Entry | None:
        entry = self._entries.get(uid)
        if entry is not None:
            self._policy.touch(uid)
        return entry

    def put(self, uid: str, entry: Entry, evictable: Callable[[str], bool]) -> list[str]:
        """Insert `entry`, evicting `evictable` entries until it fits. Returns the evicted uids.
        Raises RuntimeError when it cannot fit: the pool sizes the budget (>= one max-size
        adapter per GPU slot) and protects at most one entry per GPU slot, so that is a bug."""
        if uid in self._entries:
            raise RuntimeError(f"adapter {uid} is already cached")
        evicted = []
        while self.nbytes + entry.nbytes > self.budget_bytes:
            victim = self._policy.victim(evictable)
            if victim is None:
                raise RuntimeError(
                    f"host adapter cache: {entry.nbytes} bytes do not fit in {self.budget_bytes - self.nbytes} free "
                    "and nothing is evictable"
                )
            self.remove(victim)
            evicted.append(victim)
        self._entries[uid] = entry
        self.nbytes += entry.nbytes
        self._policy.touch(uid)
        return evicted

    def evict_until(
        self,
        attempt: Callable[[], Result | None],
        evictable: Callable[[str], bool],
        group: Callable[[Entry], int],
    ) -> tuple[Result | None, list[str]]:
        """Call `attempt` until it returns something, evicting one `evictable` entry before each new
        try: the policy's victim, then, while that is not enough, the policy's victims among the
        entries in the same `group` as it (the arena section: so that one section empties rather than
        holes opening all over the arena), then the next victim anywhere. Returns (what `attempt`
        returned, or None once nothing evictable is left; the evicted uids)."""
        evicted: list[str] = []
        near: int | None = None  # the group of the last victim
        while (result := attempt()) is None:
            victim = self._policy.victim(
                lambda uid, near=near: evictable(uid) and (near is None or group(self._entries[uid]) == near)
            )
            if victim is None:
                if near is None:
                    return None, evicted
                near = None
                continue
            near = group(self._entries[victim])
            self.remove(victim)
            evicted.append(victim)
        return result, evicted

    def remove(self, uid: str) -> None:
        entry = self._entries.pop(uid)
        self.nbytes -= entry.nbytes
        self._policy.forget(uid)
        self._released(entry)

    def bookkeeping_size(self) -> int:
        return len(self._entries) + len(self._policy)
