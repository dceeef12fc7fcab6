"""The engine's logits against transformers + PEFT, in float32, for every supported family."""

from __future__ import annotations

import torch

from tests.engine.engine_driver import BlockPool, PagedSequence, build_step, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.tiny_hf import VOCAB_SIZE, TinyCheckpoint, oracle_greedy, oracle_logits

TOLERANCE = 1e-4
SLOTS = {"all_r8": 2, "attn_r4_rslora": 0, "mlp_k_r4": 3}  # slot 1 stays empty


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (length,), generator=generator).tolist()


def engine_for(checkpoint: TinyCheckpoint):
    return load_model(
        checkpoint.model_dir, checkpoint.info, {slot: checkpoint.adapters[name] for name, slot in SLOTS.items()}
    )


# (adapter name or None for the base model, prompt length): several adapters, the base model, one
# adapter twice, prompts of different lengths
MIXED = [(None, 7), ("all_r8", 5), ("attn_r4_rslora", 11), ("mlp_k_r4", 1), ("all_r8", 9), (None, 3)]


def mixed_sequences() -> list[tuple[str | None, PagedSequence]]:
    return [
        (adapter, PagedSequence(random_prompt(length, seed), slot=-1 if adapter is None else SLOTS[adapter]))
        for seed, (adapter, length) in enumerate(MIXED)
    ]


def test_mixed_batch_of_adapters_and_base_matches_hf(checkpoint: TinyCheckpoint) -> None:
    model = engine_for(checkpoint)
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)
    seqs = mixed_sequences()

    logits = prefill([seq for _, seq in seqs], model, kv_cache, BlockPool(64))

    assert logits.dtype == torch.float32 and logits.shape == (len(seqs), VOCAB_SIZE)
    for row, (adapter, seq) in enumerate(seqs):
        expected = oracle_logits(checkpoint.oracle, seq.token_ids, adapter)[-1]
        assert (logits[row] - expected).abs().max() <= TOLERANCE, f"sequence {row} ({adapter})"


def assert_greedy_decode_matches(model, oracle, steps: int) -> None:
    """The first four mixed sequences decoded greedily `steps` tokens through the paged cache (one
    prefill, then one-token steps) give the oracle's tokens, adapter by adapter."""
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)
    pool = BlockPool(64, seed=1)
    seqs = mixed_sequences()[:4]

    next_tokens = prefill([seq for _, seq in seqs], model, kv_cache, pool).argmax(-1).tolist()
    for _ in range(steps - 1):
        for (_, seq), token in zip(seqs, next_tokens, strict=True):
            seq.token_ids.append(token)
        batch = build_step([(seq, 1) for _, seq in seqs], model, kv_cache, pool)
        next_tokens = model(batch, kv_cache).argmax(-1).tolist()
    for (_, seq), token in zip(seqs, next_tokens, strict=True):
        seq.token_ids.append(token)

    for seed, (adapter, seq) in enumerate(seqs):
        prompt = random_prompt(MIXED[seed][1], seed)
        assert seq.token_ids[len(prompt) :] == oracle_greedy(oracle, prompt, adapter, steps)


def test_greedy_decode_through_paged_cache_matches_hf(checkpoint: TinyCheckpoint) -> None:
    assert_greedy_decode_matches(engine_for(checkpoint), checkpoint.oracle, steps=6)


def test_chunked_prefill_beside_a_decode_matches_hf(llama: TinyCheckpoint) -> None:
    model = engine_for(llama)
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)
    pool = BlockPool(64, seed=2)
    long_prompt = PagedSequence(random_prompt(13, seed=10), slot=SLOTS["all_r8"])
    decoding = PagedSequence(random_prompt(6, seed=11), slot=SLOTS["mlp_k_r4"])
    prefill([decoding], model, kv_cache, pool)
    decoding.token_ids.append(42)

    # step 1: the first 6 prompt tokens alone; step 2: the other 7 (attending to the cached 6) and
    # one decode token of another sequence
    model(build_step([(long_prompt, 6)], model, kv_cache, pool), kv_cache)
    logits = model(build_step([(long_prompt, 7), (decoding, 1)], model, kv_cache, pool), kv_cache)

    expected_long = oracle_logits(llama.oracle, long_prompt.token_ids, "all_r8")[-1]
    expected_decode = oracle_logits(llama.oracle, decoding.token_ids, "mlp_k_r4")[-1]
    assert (logits[0] - expected_long).abs().max() <= TOLERANCE
    assert (logits[1] - expected_decode).abs().max() <= TOLERANCE
