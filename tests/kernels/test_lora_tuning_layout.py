"""The tuner's token layout and adapter counts: the steps it tunes look like the steps a worker serves."""

from __future__ import annotations

from itertools import groupby

import pytest

from kernels.lora.tuning import served_adapters
from kernels.lora.tuning.layer import MIXED_DECODES, PREFILL_CHUNK, slot_layout


@pytest.mark.parametrize("num_tokens", [1, 8, 96, 256])
def test_up_to_256_tokens_every_token_is_a_decode_and_the_adapters_are_shared_evenly(num_tokens: int) -> None:
    adapters = min(num_tokens, 40)
    layout = slot_layout(num_tokens, adapters)
    counts = sorted(layout.count(slot) for slot in set(layout))
    assert len(layout) == num_tokens and len(counts) == adapters
    assert counts[-1] - counts[0] <= 1


@pytest.mark.parametrize("num_tokens", [272, 384, 1024, 4096])
def test_a_larger_step_is_the_decodes_then_prefill_chunks_of_one_adapter_each(num_tokens: int) -> None:
    layout = slot_layout(num_tokens, 40)
    assert len(layout) == num_tokens and len(set(layout[:MIXED_DECODES])) == 40
    chunks = [len(list(run)) for _, run in groupby(layout[MIXED_DECODES:])]
    # adjacent chunks take different adapters (in turn), so each run of one slot is one chunk
    assert sum(chunks) == num_tokens - MIXED_DECODES
    assert max(chunks) <= PREFILL_CHUNK and max(chunks) - min(chunks) <= 1


def test_buckets_are_tuned_over_fewer_adapters_in_small_steps_and_never_more_than_their_tokens() -> None:
    assert [served_adapters(t) for t in (1, 8, 32, 64, 96, 384, 4096)] == [1, 8, 16, 16, 40, 40, 40]
