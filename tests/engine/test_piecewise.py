"""The pieces piecewise CUDA graphs capture (worker/engine/piecewise_graphs.py), run directly on the
CPU: a step through the static buffers, padded to its bucket, equals the model's plain forward,
and padding rows write nowhere but the scratch block. The graphs themselves: test_piecewise_gpu.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.engine.engine_driver import BlockPool, PagedSequence, build_step, make_kv_cache
from tests.engine.engines import load_model
from tests.engine.test_model_oracle import SLOTS, random_prompt
from tests.engine.test_moe_oracle import SLOTS as MOE_SLOTS
from tests.engine.tiny_hf import TinyCheckpoint
from tests.engine.tiny_moe import MOE_FAMILIES, TinyMoE, build_tiny_moe
from worker.engine.piecewise_graphs import PieceState, StepPieces, token_buckets
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.model.model import CausalLM

NUM_BLOCKS = 64  # the block pool's; the cache has one more, the scratch block
BLOCK_SIZE = 4


def test_buckets_climb_in_steps_that_waste_at_most_a_fifth_past_64_tokens() -> None:
    sizes = token_buckets(2048)
    assert sizes[:6] == [16, 32, 48, 64, 96, 128] and sizes[-1] == 2048
    assert sizes == sorted(set(sizes))
    assert all(b / a <= 1.5 for a, b in itertools.pairwise(sizes[3:]))
    assert all(b / a <= 1.25 for a, b in itertools.pairwise(sizes[5:]))
    assert token_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert token_buckets(8) == [8]


def run_pieces(pieces: StepPieces, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
    """One step through `pieces`, each piece called directly, as PiecewiseGraphs replays them."""
    size = next(s for s in token_buckets(pieces.max_tokens) if s >= batch.num_tokens)
    lora = batch.lora
    state = PieceState(with_lora=lora is not None)
    token_slots = None if lora is None else lora.token_slots
    plain = ForwardBatch(**{field: getattr(batch, field) for field in ForwardBatch.__slots__ if field != "lora"})
    with torch.inference_mode():
        return pieces.run(plain, token_slots, size, kv_cache, lambda index: pieces.piece(index, size, state, kv_cache))


def assert_pieces_equal_the_forward(model: CausalLM, work: list[tuple[PagedSequence, int]], max_tokens: int) -> None:
    """The step of `work` through the pieces (bucket padding included) and through model.forward,
    on two copies of one cache: equal logits, equal caches but for the scratch block."""
    caches = [make_kv_cache(model, num_blocks=NUM_BLOCKS + 1, block_size=BLOCK_SIZE) for _ in range(2)]
    for cache in caches:  # the scratch block's old contents must survive nowhere else
        for tensor in (*cache.key, *cache.value):
            tensor[NUM_BLOCKS].fill_(float("nan"))
    batch = build_step(work, model, caches[0], BlockPool(NUM_BLOCKS))
    pieces = StepPieces(model, max_tokens, scratch_slot=NUM_BLOCKS * BLOCK_SIZE)

    expected = model(batch, caches[0])
    logits = run_pieces(pieces, batch, caches[1])

    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for reference, written in zip(caches[0].key + caches[0].value, caches[1].key + caches[1].value, strict=True):
        # padded GEMMs may sum in another order: rounding, and no NaN of the scratch block
        torch.testing.assert_close(written[:NUM_BLOCKS], reference[:NUM_BLOCKS], rtol=1e-5, atol=1e-6)
    assert batch.num_tokens < next(s for s in token_buckets(max_tokens) if s >= batch.num_tokens), "no padding ran"


def mixed_work(slots: dict[str, int], lengths: list[tuple[str | None, int]]) -> list[tuple[PagedSequence, int]]:
    """Prefill chunks of sequences with these adapters (None: base) and prompt lengths."""
    work = []
    for seed, (adapter, length) in enumerate(lengths):
        seq = PagedSequence(random_prompt(length, seed), slot=-1 if adapter is None else slots[adapter])
        work.append((seq, length))
    return work


@pytest.mark.parametrize("with_adapters", [True, False], ids=["adapters", "base"])
def test_a_padded_mixed_step_equals_the_forward(checkpoint: TinyCheckpoint, with_adapters: bool) -> None:
    model = load_model(
        checkpoint.model_dir, checkpoint.info, {slot: checkpoint.adapters[name] for name, slot in SLOTS.items()}
    )
    adapters = ["all_r8", "attn_r4_rslora", "mlp_k_r4", None] if with_adapters else [None] * 4
    work = mixed_work(SLOTS, list(zip(adapters, [7, 5, 11, 1], strict=True)))  # 24 tokens: bucket 32
    assert_pieces_equal_the_forward(model, work, max_tokens=64)


def test_a_step_after_a_larger_one_is_not_read_from_its_stale_rows(llama: TinyCheckpoint) -> None:
    model = load_model(llama.model_dir, llama.info, {slot: llama.adapters[name] for name, slot in SLOTS.items()})
    cache = make_kv_cache(model, num_blocks=NUM_BLOCKS + 1, block_size=BLOCK_SIZE)
    pieces = StepPieces(model, 64, scratch_slot=NUM_BLOCKS * BLOCK_SIZE)
    pool = BlockPool(NUM_BLOCKS)
    run_pieces(pieces, build_step(mixed_work(SLOTS, [("all_r8", 30), (None, 17)]), model, cache, pool), cache)

    small = mixed_work(SLOTS, [("mlp_k_r4", 3), (None, 2)])
    reference_cache = make_kv_cache(model, num_blocks=NUM_BLOCKS + 1, block_size=BLOCK_SIZE)
    expected = model(build_step(small, model, reference_cache, BlockPool(NUM_BLOCKS, seed=3)), reference_cache)
    for seq, _ in small:
        seq.cached = 0
    logits = run_pieces(pieces, build_step(small, model, cache, BlockPool(NUM_BLOCKS, seed=3)), cache)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyMoE:
    return build_tiny_moe(request.param, Path(tmp_path_factory.mktemp(request.param)))


def test_a_padded_mixed_step_of_an_moe_model_equals_the_forward(tiny_moe: TinyMoE) -> None:
    model = load_model(
        tiny_moe.model_dir, tiny_moe.info, {slot: tiny_moe.adapters[name] for name, slot in MOE_SLOTS.items()}
    )
    names = list(MOE_SLOTS)
    work = mixed_work(MOE_SLOTS, [(names[0], 6), (None, 4), (names[1], 9), (names[2], 1)])
    assert_pieces_equal_the_forward(model, work, max_tokens=32)
