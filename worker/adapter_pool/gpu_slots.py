"""Which adapters occupy the device's LoRA pages, and the slot each is read through (torch-free).

The device keeps its adapters in a paged pool (CausalLM: pages of `page_rank` rank rows for every
adapted projection): an adapter of rank r takes cdiv(r, page_rank) pages, wherever they are free, so
adapters of different ranks share one budget without fragmenting it (S-LoRA's unified paging; the
model's page table maps each slot's ranks to its pages). An adapter's slot is its first page: pages
are exclusive, so no two resident adapters share a slot.

An adapter is LOADING while its weights are being copied in (no request may use it yet), then READY.
A READY adapter is pinned while any running sequence uses it. The pool reserves pages for adapters it
prefetches: free pages first, then those of READY, unpinned adapters that the pool's `evictable` test
accepts (ones nobody is waiting for), in the eviction policy's order, as many as the new adapter needs.
Identity is the adapter's uid (name, version, content hash), so a re-registered adapter never reuses
the pages of its previous version's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from worker.adapter_pool.eviction import EvictionPolicy


class SlotState(Enum):
    LOADING = "loading"
    READY = "ready"


@dataclass(slots=True)
class _Occupant:
    pages: tuple[int, ...]  # in rank order; the slot is the first
    state: SlotState
    pins: int = 0  # running sequences using the adapter


@dataclass(frozen=True, slots=True)
class Reservation:
    pages: tuple[int, ...]  # the adapter's pages, in rank order
    evicted_uids: tuple[str, ...]  # adapters whose pages these were, if any

    @property
    def slot(self) -> int:
        return self.pages[0]


class GpuSlots:
    def __init__(self, num_pages: int, policy: EvictionPolicy) -> None:
        """`num_pages` 0: a model without LoRA, where no adapter is ever resident."""
        if num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        self.num_pages = num_pages
        self._policy = policy
        self._occupants: dict[str, _Occupant] = {}
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first

    def slot_of(self, uid: str) -> int | None:
        """The slot of a READY adapter (the one the model reads); None while absent or loading."""
        occupant = self._occupants.get(uid)
        return occupant.pages[0] if occupant is not None and occupant.state is SlotState.READY else None

    def holds(self, uid: str) -> bool:
        """Whether `uid` has pages, READY or LOADING."""
        return uid in self._occupants

    @property
    def resident(self) -> list[str]:
        """uids of READY adapters."""
        return [uid for uid, o in self._occupants.items() if o.state is SlotState.READY]

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def acquire(self, uid: str) -> int | None:
        """Pin a READY adapter for one running sequence and return its slot; None if it is not READY."""
        occupant = self._occupants.get(uid)
        if occupant is None or occupant.state is not SlotState.READY:
            return None
        occupant.pins += 1
        self._policy.touch(uid)
        return occupant.pages[0]

    def release(self, uid: str) -> None:
        """Unpin one use of `uid`; at zero uses it stays resident but becomes evictable."""
        occupant = self._occupants[uid]
        if occupant.pins < 1:
            raise RuntimeError(f"adapter {uid} released more often than acquired")
        occupant.pins -= 1

    def reserve(self, uid: str, num_pages: int, evictable: Callable[[str], bool]) -> Reservation | None:
        """`num_pages` pages for `uid` to be loaded into (state LOADING); None, evicting nothing, when
        the free pages and those of idle `evictable` adapters together are too few."""
        if uid in self._occupants:
            raise RuntimeError(f"adapter {uid} already has pages")
        if not 1 <= num_pages <= self.num_pages:
            raise ValueError(f"an adapter cannot take {num_pages} of {self.num_pages} pages")
        victims: list[str] = []
        available = len(self._free_pages)
        while available < num_pages:
            victim = self._policy.victim(lambda other: other not in victims and self._idle(other) and evictable(other))
            if victim is None:
                return None
            victims.append(victim)
            available += len(self._occupants[victim].pages)
        for victim in victims:
            self._free_pages.extend(self._occupants.pop(victim).pages)
            self._policy.forget(victim)
        pages = tuple(self._free_pages.pop() for _ in range(num_pages))
        self._occupants[uid] = _Occupant(pages, SlotState.LOADING)
        return Reservation(pages, tuple(victims))

    def _idle(self, uid: str) -> bool:
        occupant = self._occupants[uid]
        return occupant.state is SlotState.READY and occupant.pins == 0

    def mark_ready(self, uid: str) -> None:
        """The adapter's weights have landed: requests may use it."""
        self._occupants[uid].state = SlotState.READY
        self._policy.touch(uid)

    def discard(self, uid: str) -> None:
        """Forget `uid` (its load failed): its pages become free."""
        occupant = self._occupants.pop(uid)
        self._policy.forget(uid)
        self._free_pages.extend(occupant.pages)

    def bookkeeping_size(self) -> int:
        """Entries held across the page map, free list and policy: bounded by the pages however many
        adapters came and went."""
        return len(self._occupants) + len(self._free_pages) + len(self._policy)
