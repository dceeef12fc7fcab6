"""Which resident adapter a tier gives up when it needs room: the one place eviction is decided.

A tier (GPU slots, the pinned host cache) tells its policy when an adapter is used (`touch`) and
when it leaves (`forget`), and asks for a `victim` among the adapters it may evict. The tier, not
the policy, decides what is evictable (an adapter in the running batch, or one that queued
requests are waiting for, never is), so a policy only ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable


class EvictionPolicy(ABC):
    @abstractmethod
    def touch(self, uid: str) -> None:
        """`uid` was used (admitted into a batch, read from the tier); starts tracking it if new."""

    @abstractmethod
    def forget(self, uid: str) -> None:
        """`uid` left the tier (evicted or failed): drop everything kept about it."""

    @abstractmethod
    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        """The tracked uid to evict among those `evictable` accepts; None if there is none."""

    @abstractmethod
    def __len__(self) -> int:
        """How many uids the policy tracks (bookkeeping must shrink back as adapters leave)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest use first

    def touch(self, uid: str) -> None:
        self._order[uid] = None
        self._order.move_to_end(uid)

    def forget(self, uid: str) -> None:
        self._order.pop(uid, None)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        return next((uid for uid in self._order if evictable(uid)), None)

    def __len__(self) -> int:
        return len(self._order)


class FrequencyPolicy(EvictionPolicy):
    """Least frequently used first, ties broken by least recent use. Counts are halved every
    `half_life` uses, so an adapter that was popular an hour ago does not squat a slot forever.

    Under Zipf traffic this keeps the head adapters resident through bursts of one-off tail
    adapters, which LRU would let push the head out.
    """

    def __init__(self, half_life: int = 1024) -> None:
        if half_life < 1:
            raise ValueError("half_life must be >= 1")
        self._half_life = half_life
        self._uses: dict[str, float] = {}
        self._last: dict[str, int] = {}
        self._clock = 0

    def touch(self, uid: str) -> None:
        self._clock += 1
        self._uses[uid] = self._uses.get(uid, 0.0) + 1.0
        self._last[uid] = self._clock
        if self._clock % self._half_life == 0:
            for key in self._uses:
                self._uses[key] /= 2

    def forget(self, uid: str) -> None:
        self._uses.pop(uid, None)
        self._last.pop(uid, None)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        candidates = [uid for uid in self._uses if evictable(uid)]
        return min(candidates, key=lambda uid: (self._uses[uid], self._last[uid]), default=None)

    def __len__(self) -> int:
        return len(self._uses)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": FrequencyPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its configuration name ("lru" or "lfu")."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]()
