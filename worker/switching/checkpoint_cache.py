"""The warm tier: whole checkpoints held in (pinned, where CUDA is present) host memory, LRU by bytes.

A warm model becomes resident by one host-to-device copy per tensor, at the pinned H2D bandwidth,
instead of a disk read. The cache only holds references: a model being copied to the device keeps
its tensors alive through its own reference even if the cache evicts it meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HostWeights:
    """One checkpoint in host memory: tensors under their checkpoint names (views into per-file
    buffers), and the bytes they take."""

    model: str
    tensors: dict[str, torch.Tensor]
    nbytes: int
    pinned: bool
    keepalive: tuple[object, ...] = ()  # what keeps the buffers page-locked (shard_reader.PageLock) while held


class CheckpointCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("the host model cache's capacity must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, HostWeights] = OrderedDict()  # least recently used first

    @property
    def used_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, model: str) -> bool:
        return model in self._entries

    def get(self, model: str) -> HostWeights | None:
        """The model's weights, now the most recently used; None if not cached."""
        entry = self._entries.get(model)
        if entry is not None:
            self._entries.move_to_end(model)
        return entry

    def put(self, weights: HostWeights) -> list[str]:
        """Cache `weights`, evicting least recently used models until they fit; returns the evicted
        names. A checkpoint larger than the whole cache is not kept (returns [] and caches nothing)."""
        if weights.nbytes > self.capacity_bytes:
            return []
        self._entries.pop(weights.model, None)
        evicted = []
        while self._entries and self.used_bytes + weights.nbytes > self.capacity_bytes:
            name, _ = self._entries.popitem(last=False)
            evicted.append(name)
        self._entries[weights.model] = weights
        return evicted
