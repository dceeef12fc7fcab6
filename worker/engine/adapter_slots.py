"""Which adapter occupies which of the device's LoRA slots (torch-free bookkeeping).

A slot is pinned while any running sequence uses its adapter; only unpinned adapters are evicted,
least recently used first. Identity is the adapter's uid (name, version, content hash), so a
re-registered adapter never reuses the slot of its previous version's weights.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotGrant:
    slot: int
    needs_load: bool  # the slot holds other weights: the caller must load this adapter into it
    evicted_uid: str | None = None


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._pins: Counter[str] = Counter()
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned; oldest first
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def slot_of(self, uid: str) -> int | None:
        return self._slot_of.get(uid)

    @property
    def resident(self) -> list[str]:
        return list(self._slot_of)

    def acquire(self, uid: str) -> SlotGrant | None:
        """Pin `uid` into a slot. None when it is not resident and every slot is pinned."""
        slot = self._slot_of.get(uid)
        if slot is not None:
            self._idle.pop(uid, None)
            self._pins[uid] += 1
            return SlotGrant(slot, needs_load=False)
        evicted = None
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self._slot_of.pop(evicted)
        else:
            return None
        self._slot_of[uid] = slot
        self._pins[uid] += 1
        return SlotGrant(slot, needs_load=True, evicted_uid=evicted)

    def release(self, uid: str) -> None:
        """Unpin one use of `uid`; at zero uses it stays resident but becomes evictable."""
        self._pins[uid] -= 1
        if self._pins[uid] == 0:
            del self._pins[uid]
            self._idle[uid] = None

    def discard(self, uid: str) -> None:
        """Forget `uid` entirely (its load failed): the slot becomes free."""
        slot = self._slot_of.pop(uid, None)
        self._pins.pop(uid, None)
        self._idle.pop(uid, None)
        if slot is not None:
            self._free_slots.append(slot)
