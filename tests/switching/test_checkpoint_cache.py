"""The warm tier's LRU by bytes."""

from __future__ import annotations

import pytest
import torch

from worker.switching.checkpoint_cache import CheckpointCache, HostWeights


def weights(model: str, nbytes: int) -> HostWeights:
    return HostWeights(model, {"w": torch.zeros(nbytes, dtype=torch.uint8)}, nbytes, pinned=False)


def test_least_recently_used_model_is_evicted_first() -> None:
    cache = CheckpointCache(300)
    assert cache.put(weights("a", 100)) == []
    assert cache.put(weights("b", 100)) == []
    assert cache.get("a") is not None  # a is now the most recent
    assert cache.put(weights("c", 150)) == ["b"]
    assert cache.names() == ["a", "c"]
    assert cache.used_bytes == 250


def test_eviction_frees_as_many_models_as_the_new_one_needs() -> None:
    cache = CheckpointCache(300)
    for name in "abc":
        cache.put(weights(name, 100))
    assert cache.put(weights("d", 250)) == ["a", "b", "c"]
    assert cache.names() == ["d"]


def test_a_checkpoint_larger_than_the_cache_is_not_kept_and_evicts_nothing() -> None:
    cache = CheckpointCache(100)
    cache.put(weights("a", 80))
    assert cache.put(weights("huge", 101)) == []
    assert cache.names() == ["a"]
    assert cache.get("huge") is None


def test_putting_a_cached_model_again_replaces_it() -> None:
    cache = CheckpointCache(200)
    cache.put(weights("a", 100))
    cache.put(weights("a", 150))
    assert cache.names() == ["a"] and cache.used_bytes == 150


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        CheckpointCache(-1)
