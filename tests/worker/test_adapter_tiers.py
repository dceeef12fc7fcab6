"""The adapter pool's torch-free bookkeeping: GPU slots, the host cache and the eviction policies."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from worker.adapter_pool.eviction import FrequencyPolicy, LRUPolicy, make_policy
from worker.adapter_pool.gpu_slots import GpuSlots
from worker.adapter_pool.host_cache import HostCache


def anything(_: str) -> bool:
    return True


def loaded(slots: GpuSlots, uid: str) -> int:
    reservation = slots.reserve(uid, evictable=anything)
    assert reservation is not None
    slots.mark_ready(uid)
    return reservation.slot


@dataclass(frozen=True)
class Blob:
    nbytes: int


def test_a_loading_slot_is_not_usable_until_marked_ready():
    slots = GpuSlots(2, LRUPolicy())
    slot = slots.reserve("a", evictable=anything).slot
    assert slots.holds("a") and slots.slot_of("a") is None and slots.acquire("a") is None
    slots.mark_ready("a")
    assert slots.acquire("a") == slot == slots.slot_of("a")


def test_gpu_slots_evict_the_least_recently_used_idle_adapter():
    slots = GpuSlots(2, LRUPolicy())
    slot_a, slot_b = loaded(slots, "a"), loaded(slots, "b")
    slots.acquire("a")
    slots.release("a")  # a used after b
    reservation = slots.reserve("c", evictable=anything)
    assert (reservation.slot, reservation.evicted_uid) == (slot_b, "b")
    assert slots.slot_of("b") is None and slots.slot_of("a") == slot_a


def test_gpu_slots_never_evict_pinned_loading_or_protected_adapters():
    slots = GpuSlots(3, LRUPolicy())
    loaded(slots, "pinned")
    slots.acquire("pinned")
    slots.reserve("loading", evictable=anything)
    loaded(slots, "wanted")
    assert slots.reserve("new", evictable=lambda uid: uid != "wanted") is None
    assert slots.reserve("new", evictable=anything).evicted_uid == "wanted"


def test_a_released_adapter_stays_resident_and_is_reused_without_a_load():
    slots = GpuSlots(1, LRUPolicy())
    slot = loaded(slots, "a")
    slots.acquire("a")
    slots.release("a")
    assert slots.acquire("a") == slot
    with pytest.raises(RuntimeError, match="already has a slot"):
        slots.reserve("a", evictable=anything)


def test_discard_frees_the_slot_of_a_failed_load():
    slots = GpuSlots(1, LRUPolicy())
    slots.reserve("bad", evictable=anything)
    slots.discard("bad")
    assert slots.reserve("good", evictable=anything).slot == 0
    assert slots.bookkeeping_size() == 1  # the slot map only: the policy tracks READY adapters


def test_frequency_policy_keeps_a_popular_adapter_that_lru_would_evict():
    lru, lfu = GpuSlots(2, LRUPolicy()), GpuSlots(2, FrequencyPolicy())
    for slots in (lru, lfu):
        loaded(slots, "hot")
        for _ in range(5):
            slots.acquire("hot")
            slots.release("hot")
        loaded(slots, "tail-1")
    assert lru.reserve("tail-2", evictable=anything).evicted_uid == "hot"
    assert lfu.reserve("tail-2", evictable=anything).evicted_uid == "tail-1"


def test_frequency_policy_forgets_old_popularity():
    policy = FrequencyPolicy(half_life=4)
    for _ in range(8):
        policy.touch("old")
    for _ in range(20):
        policy.touch("new")
    assert policy.victim(anything) == "old"
    policy.forget("old")
    assert len(policy) == 1


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="lru, lfu"):
        make_policy("random")


def test_host_cache_evicts_within_its_byte_budget():
    cache: HostCache[Blob] = HostCache(100, LRUPolicy())
    assert cache.put("a", Blob(40), anything) == []
    assert cache.put("b", Blob(40), anything) == []
    cache.get("a")
    assert cache.put("c", Blob(40), anything) == ["b"]
    assert cache.nbytes == 80 and sorted(cache.resident) == ["a", "c"]


def test_host_cache_skips_protected_entries_and_refuses_what_cannot_fit():
    cache: HostCache[Blob] = HostCache(100, LRUPolicy())
    cache.put("window", Blob(60), anything)
    cache.put("old", Blob(30), anything)
    assert cache.put("next", Blob(30), evictable=lambda uid: uid != "window") == ["old"]
    with pytest.raises(RuntimeError, match="nothing is evictable"):
        cache.put("huge", Blob(90), evictable=lambda uid: False)
