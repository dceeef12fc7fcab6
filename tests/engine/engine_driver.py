"""Drives the model in tests (loaded by tests/engine/engines.py): just enough of a scheduler and block
manager to run steps (sequences owning scattered cache blocks, and the ForwardBatch of one step over
some of their tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kernels.lora import LoRABatch
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.model import CausalLM


class BlockPool:
    """Hands out cache blocks in a shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, *, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


@dataclass
class PagedSequence:
    token_ids: list[int]  # prompt plus generated tokens; K/V of the first `cached` are in the cache
    slot: int = -1  # adapter slot, -1 for the base model
    blocks: list[int] = field(default_factory=list)
    cached: int = 0


def make_kv_cache(model: CausalLM, *, num_blocks: int, block_size: int) -> KVCache:
    info = model.info
    layout = KVLayout.of(info, block_size, model.dtype)
    return KVCache.allocate(layout, num_blocks, torch.device("cpu"))


def build_step(
    work: list[tuple[PagedSequence, int]], model: CausalLM, kv_cache: KVCache, pool: BlockPool
) -> ForwardBatch:
    """The batch that runs `n` more tokens of each (sequence, n) in `work`, allocating blocks as
    needed and advancing each sequence's `cached`. Logits come from each sequence's last new token."""
    block_size = kv_cache.block_size
    input_ids, positions, slot_mapping, token_slots = [], [], [], []
    query_start_loc, context_lens, logits_indices = [0], [], []
    for seq, n in work:
        new_positions = range(seq.cached, seq.cached + n)
        while len(seq.blocks) * block_size < seq.cached + n:
            seq.blocks.append(pool.take())
        input_ids += seq.token_ids[seq.cached : seq.cached + n]
        positions += new_positions
        slot_mapping += [seq.blocks[p // block_size] * block_size + p % block_size for p in new_positions]
        token_slots += [seq.slot] * n
        query_start_loc.append(query_start_loc[-1] + n)
        context_lens.append(seq.cached + n)
        logits_indices.append(query_start_loc[-1] - 1)
        seq.cached += n
    max_blocks = max(len(seq.blocks) for seq, _ in work)
    block_tables = [seq.blocks + [-1] * (max_blocks - len(seq.blocks)) for seq, _ in work]
    lora = None
    if any(slot >= 0 for slot in token_slots):
        lora = LoRABatch.build(torch.tensor(token_slots), model.slot_ranks, model.slot_scales, model.slot_pages)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        max_query_len=max(n for _, n in work),
        max_context_len=max(context_lens),
        lora=lora,
    )


def prefill(seqs: list[PagedSequence], model: CausalLM, kv_cache: KVCache, pool: BlockPool) -> torch.Tensor:
    """Run every sequence's uncached tokens in one step; logits float32 [len(seqs), vocab]."""
    work = [(seq, len(seq.token_ids) - seq.cached) for seq in seqs]
    return model(build_step(work, model, kv_cache, pool), kv_cache)
