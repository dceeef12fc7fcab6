"""The adapter pool's torch-free bookkeeping: GPU pages and slots, the host cache and the eviction policies."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from worker.adapter_pool.eviction import FrequencyPolicy, LRUPolicy, make_policy
from worker.adapter_pool.gpu_slots import GpuSlots
from worker.adapter_pool.host_tier import HostTier


def anything(_: str) -> bool:
    return True


def loaded(slots: GpuSlots, uid: str) -> int:
    reservation = slots.reserve(uid, 1, evictable=anything)
    assert reservation is not None
    slots.mark_ready(uid)
    return reservation.slot


@dataclass(frozen=True)
class Blob:
    nbytes: int


def test_a_loading_slot_is_not_usable_until_marked_ready():
    slots = GpuSlots(2, LRUPolicy())
    slot = slots.reserve("a", 1, evictable=anything).slot
    assert slots.holds("a") and slots.slot_of("a") is None and slots.acquire("a") is None
    slots.mark_ready("a")
    assert slots.acquire("a") == slot == slots.slot_of("a")


def test_gpu_slots_evict_the_least_recently_used_idle_adapter():
    slots = GpuSlots(2, LRUPolicy())
    slot_a, slot_b = loaded(slots, "a"), loaded(slots, "b")
    slots.acquire("a")
    slots.release("a")  # a used after b
    reservation = slots.reserve("c", 1, evictable=anything)
    assert (reservation.slot, reservation.evicted_uids) == (slot_b, ("b",))
    assert slots.slot_of("b") is None and slots.slot_of("a") == slot_a


def test_gpu_slots_never_evict_pinned_loading_or_protected_adapters():
    slots = GpuSlots(3, LRUPolicy())
    loaded(slots, "pinned")
    slots.acquire("pinned")
    slots.reserve("loading", 1, evictable=anything)
    loaded(slots, "wanted")
    assert slots.reserve("new", 1, evictable=lambda uid: uid != "wanted") is None
    assert slots.reserve("new", 1, evictable=anything).evicted_uids == ("wanted",)


def test_a_released_adapter_stays_resident_and_is_reused_without_a_load():
    slots = GpuSlots(1, LRUPolicy())
    slot = loaded(slots, "a")
    slots.acquire("a")
    slots.release("a")
    assert slots.acquire("a") == slot
    with pytest.raises(RuntimeError, match="already has pages"):
        slots.reserve("a", 1, evictable=anything)


def test_discard_frees_the_slot_of_a_failed_load():
    slots = GpuSlots(1, LRUPolicy())
    slots.reserve("bad", 1, evictable=anything)
    slots.discard("bad")
    assert slots.reserve("good", 1, evictable=anything).slot == 0
    assert slots.bookkeeping_size() == 1  # the slot map only: the policy tracks READY adapters


def test_adapters_of_several_pages_take_free_pages_anywhere_and_their_first_is_the_slot():
    slots = GpuSlots(6, LRUPolicy())
    for uid in "abcdef":
        loaded(slots, uid)
    reservation = slots.reserve("big", 2, evictable=lambda uid: uid in ("b", "e"))  # pages 1 and 4
    assert reservation is not None and reservation.evicted_uids == ("b", "e")
    assert sorted(reservation.pages) == [1, 4] and reservation.slot == reservation.pages[0]
    slots.mark_ready("big")
    assert slots.slot_of("big") == reservation.pages[0] and slots.free_pages == 0
    assert {slots.slot_of(uid) for uid in "acdf"} == {0, 2, 3, 5}


def test_a_large_adapter_evicts_as_many_idle_small_ones_as_it_needs_in_policy_order():
    slots = GpuSlots(4, LRUPolicy())
    for uid in ("a", "b", "c", "d"):
        loaded(slots, uid)
    for uid in ("a", "c"):  # a and c used last: b and d go first
        slots.acquire(uid)
        slots.release(uid)
    reservation = slots.reserve("big", 2, evictable=anything)
    assert reservation is not None and reservation.evicted_uids == ("b", "d")
    assert slots.slot_of("a") is not None and slots.slot_of("c") is not None


def test_a_reservation_that_cannot_be_met_evicts_nothing():
    slots = GpuSlots(4, LRUPolicy())
    loaded(slots, "idle")
    loaded(slots, "pinned")
    slots.acquire("pinned")
    loaded(slots, "other-pinned")
    slots.acquire("other-pinned")
    assert slots.reserve("big", 3, evictable=anything) is None  # 1 free + 1 idle page < 3
    assert slots.slot_of("idle") is not None and slots.free_pages == 1
    with pytest.raises(ValueError, match="cannot take 5 of 4 pages"):
        slots.reserve("huge", 5, evictable=anything)


def test_page_bookkeeping_stays_bounded_over_many_mixed_rank_loads():
    slots = GpuSlots(8, LRUPolicy())
    for index in range(2_000):
        reservation = slots.reserve(f"adapter-{index}", 1 + index % 4, evictable=anything)
        assert reservation is not None
        slots.mark_ready(f"adapter-{index}")
        resident_pages = [p for uid in slots.resident for p in slots._occupants[uid].pages]
        assert len(resident_pages) == len(set(resident_pages)) == 8 - slots.free_pages
    assert slots.bookkeeping_size() <= 8 + 8 + 8


def test_frequency_policy_keeps_a_popular_adapter_that_lru_would_evict():
    lru, lfu = GpuSlots(2, LRUPolicy()), GpuSlots(2, FrequencyPolicy())
    for slots in (lru, lfu):
        loaded(slots, "hot")
        for _ in range(5):
            slots.acquire("hot")
            slots.release("hot")
        loaded(slots, "tail-1")
    assert lru.reserve("tail-2", 1, evictable=anything).evicted_uids == ("hot",)
    assert lfu.reserve("tail-2", 1, evictable=anything).evicted_uids == ("tail-1",)


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
    cache: HostTier[Blob] = HostTier(100, LRUPolicy())
    assert cache.put("a", Blob(40), anything) == []
    assert cache.put("b", Blob(40), anything) == []
    cache.get("a")
    assert cache.put("c", Blob(40), anything) == ["b"]
    assert cache.nbytes == 80 and sorted(cache.resident) == ["a", "c"]


def test_host_cache_skips_protected_entries_and_refuses_what_cannot_fit():
    cache: HostTier[Blob] = HostTier(100, LRUPolicy())
    cache.put("window", Blob(60), anything)
    cache.put("old", Blob(30), anything)
    assert cache.put("next", Blob(30), evictable=lambda uid: uid != "window") == ["old"]
    with pytest.raises(RuntimeError, match="nothing is evictable"):
        cache.put("huge", Blob(90), evictable=lambda uid: False)


def test_making_room_evicts_the_policys_victim_then_its_group_until_the_attempt_succeeds():
    # groups stand for arena sections: "a" and "c" share one, "b" sits in another
    cache: HostTier[Blob] = HostTier(100, LRUPolicy(), released=lambda blob: freed.append(blob.nbytes))
    freed: list[int] = []
    for uid, size in (("a", 10), ("b", 20), ("c", 30), ("d", 5)):
        cache.put(uid, Blob(size), anything)
    section = {10: 0, 30: 0, 20: 1, 5: 1}
    room, evicted = cache.evict_until(
        lambda: "carved" if sum(freed) >= 40 else None,
        evictable=lambda uid: uid != "d",
        group=lambda blob: section[blob.nbytes],
    )
    # "c" shares a's section: it goes before "b", used earlier
    assert (room, evicted, freed) == ("carved", ["a", "c"], [10, 30])
    assert cache.resident == ["b", "d"] and cache.nbytes == 25


def test_making_room_gives_up_when_nothing_evictable_is_left():
    cache: HostTier[Blob] = HostTier(100, LRUPolicy())
    cache.put("window", Blob(60), anything)
    assert cache.evict_until(lambda: None, evictable=lambda uid: False, group=lambda blob: 0) == (None, [])
    assert cache.resident == ["window"]
