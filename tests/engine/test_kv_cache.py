"""The KV cache's storage: per-layer views of one flat buffer, which models of other shapes can reuse."""

from __future__ import annotations

import itertools

import pytest
import torch

from worker.model.kv_cache import KVCache, KVLayout

LLAMA_LIKE = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
OTHER = KVLayout(num_layers=5, block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)


def test_layers_are_disjoint_views_of_the_storage_with_the_layout_shape() -> None:
    storage = torch.empty(10 * LLAMA_LIKE.bytes_per_block, dtype=torch.uint8)
    cache = KVCache.carve(LLAMA_LIKE, 10, storage)
    tensors = [*cache.key, *cache.value]
    assert len(cache.key) == len(cache.value) == 3
    assert all(t.shape == (10, 4, 2, 8) and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    start, end = storage.data_ptr(), storage.data_ptr() + storage.numel()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert spans[0][0] >= start and spans[-1][1] <= end
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    for i, tensor in enumerate(tensors):  # writes through one view land in the storage and nowhere else
        tensor.fill_(float(i + 1))
    assert sorted({t.unique().item() for t in tensors}) == [float(i + 1) for i in range(len(tensors))]


def test_another_layout_reuses_the_same_storage_and_sees_what_was_left() -> None:
    storage = torch.empty(max(LLAMA_LIKE.bytes_per_block * 6, OTHER.bytes_per_block * 6), dtype=torch.uint8)
    first = KVCache.carve(LLAMA_LIKE, LLAMA_LIKE.blocks_in(storage.numel()), storage)
    first.key[0].fill_(7.0)
    second = KVCache.carve(OTHER, OTHER.blocks_in(storage.numel()), storage)
    assert second.key[0].dtype == torch.bfloat16 and second.key[0].shape[1:] == (4, 1, 16)
    assert second.key[0].data_ptr() == first.key[0].data_ptr()  # no copy, no new memory
    assert not torch.equal(second.key[0], torch.zeros_like(second.key[0]))  # carving leaves contents alone


def test_a_storage_too_small_for_the_blocks_is_refused() -> None:
    storage = torch.empty(2 * LLAMA_LIKE.bytes_per_block, dtype=torch.uint8)
    with pytest.raises(ValueError, match="3 KV blocks need"):
        KVCache.carve(LLAMA_LIKE, 3, storage)
    with pytest.raises(ValueError, match="flat uint8"):
        KVCache.carve(LLAMA_LIKE, 1, storage.view(2, -1))


def test_allocate_zeroes_a_new_cache() -> None:
    cache = KVCache.allocate(OTHER, 3, torch.device("cpu"))
    assert all(torch.count_nonzero(t) == 0 for t in [*cache.key, *cache.value])
