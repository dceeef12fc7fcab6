"""A tensor-parallel follower's adapter copies: read once, ahead of the write that needs them, kept
for the next write of the same adapter, and the follower's own part of it."""

from __future__ import annotations

import torch

from shared.config import EngineConfig
from tests.engine.engines import host_adapter, load_model
from tests.engine.tiny_hf import TinyCheckpoint, saved_adapter_ref
from worker.adapter_pool import follower_tier
from worker.adapter_pool.follower_tier import FollowerAdapters
from worker.adapter_pool.host_adapter import fresh_buffers
from worker.adapter_pool.rank_adapter import shard_adapter
from worker.model.model import CausalLM
from worker.model.parallel.group import TensorParallel

CONFIG = EngineConfig(max_loras=2, max_lora_rank=8, dtype="float32")


def test_an_adapter_is_read_once_ahead_and_kept_for_the_next_write(llama: TinyCheckpoint, monkeypatch):
    directory = llama.adapters["all_r8"]
    reads = []

    def counted(*args, **kwargs):
        reads.append(args[0].uid)
        return follower_tier_read(*args, **kwargs)

    follower_tier_read = follower_tier.read_for_model
    monkeypatch.setattr(follower_tier, "read_for_model", counted)
    rank1 = CausalLM(llama.info, max_loras=2, max_lora_rank=8, dtype=torch.float32, tp=TensorParallel(1, 2))
    adapters = FollowerAdapters(rank1, CONFIG, directory.parent, pin=False)
    ref = saved_adapter_ref("all_r8", directory)
    try:
        adapters.read_ahead(ref)
        adapters.read_ahead(ref)  # already on its way
        part = adapters.take(ref)
        assert adapters.take(ref) is part  # a second write of it reads no disk
    finally:
        adapters.close()
    assert reads == [ref.uid]

    whole = host_adapter(directory, load_model(llama.model_dir, llama.info))
    expected = shard_adapter(whole, rank1.shard, take=fresh_buffers(pin=False))
    assert part.parts == expected.parts and torch.equal(part.buffer, expected.buffer)
