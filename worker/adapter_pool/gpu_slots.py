"""Which adapter occupies which of the device's LoRA slots (torch-free bookkeeping).

A slot is LOADING while its weights are being copied in (no request may use it yet), then READY.
A READY slot is pinned while any running sequence uses its adapter. The pool reserves slots for
adapters it prefetches; a reservation takes a free slot, or evicts a READY, unpinned adapter that
the pool's `evictable` test accepts (one nobody is waiting for), chosen by the eviction policy.
Identity is the adapter's uid (name, version, content hash), so a re-registered adapter never
reuses the slot of its previous version's weights.
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
    slot: int
    state: SlotState
    pins: int = 0  # running sequences using the adapter


@dataclass(frozen=True, slots=True)
class Reservation:
    slot: int
    evicted_uid: str | None  # the adapter whose slot this was, if any


class GpuSlots:
    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._policy = policy
        self._occupants: dict[str, _Occupant] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def slot_of(self, uid: str) -> int | None:
        """The slot of a READY adapter (the one the model reads); None while absent or loading."""
        occupant = self._occupants.get(uid)
        return occupant.slot if occupant is not None and occupant.state is SlotState.READY else None

    def holds(self, uid: str) -> bool:
        """Whether `uid` has a slot, READY or LOADING."""
        return uid in self._occupants

    @property
    def resident(self) -> list[str]:
        """uids of READY adapters."""
        return [uid for uid, o in self._occupants.items() if o.state is SlotState.READY]

    def acquire(self, uid: str) -> int | None:
        """Pin a READY adapter for one running sequence; None if it is not READY."""
        occupant = self._occupants.get(uid)
        if occupant is None or occupant.state is not SlotState.READY:
            return None
        occupant.pins += 1
        self._policy.touch(uid)
        return occupant.slot

    def release(self, uid: str) -> None:
        """Unpin one use of `uid`; at zero uses it stays resident but becomes evictable."""
        occupant = self._occupants[uid]
        if occupant.pins < 1:
            raise RuntimeError(f"adapter {uid} released more often than acquired")
        occupant.pins -= 1

    def reserve(self, uid: str, evictable: Callable[[str], bool]) -> Reservation | None:
        """A slot for `uid` to be loaded into (state LOADING); None when every slot is taken by an
        adapter that is pinned, loading, or not `evictable`."""
        if uid in self._occupants:
            raise RuntimeError(f"adapter {uid} already has a slot")
        evicted = None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            evicted = self._policy.victim(lambda other: self._idle(other) and evictable(other))
            if evicted is None:
                return None
            slot = self._occupants.pop(evicted).slot
            self._policy.forget(evicted)
        self._occupants[uid] = _Occupant(slot, SlotState.LOADING)
        return Reservation(slot, evicted)

    def _idle(self, uid: str) -> bool:
        occupant = self._occupants[uid]
        return occupant.state is SlotState.READY and occupant.pins == 0

    def mark_ready(self, uid: str) -> None:
        """The slot's weights have landed: requests may use it."""
        self._occupants[uid].state = SlotState.READY
        self._policy.touch(uid)

    def discard(self, uid: str) -> None:
        """Forget `uid` (its load failed): the slot becomes free."""
        occupant = self._occupants.pop(uid)
        self._policy.forget(uid)
        self._free_slots.append(occupant.slot)

    def bookkeeping_size(self) -> int:
        """Entries held across the slot map, free list and policy: constant once every slot is used."""
        return len(self._occupants) + len(self._free_slots) + len(self._policy)
