"""Sampling and detokenization."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.schema import SamplingParams
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.sampler import sample


def random_logits(rows: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))


def test_greedy_rows_take_the_argmax():
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.0)] * 3
    assert torch.equal(sample(logits, params, [1, 2, 3], [0, 0, 0]), logits.argmax(-1))


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    logits = random_logits(4)
    hot = SamplingParams(temperature=1.5)
    alone = sample(logits[2:3], [hot], [42], [5])
    batched = sample(logits, [SamplingParams(temperature=0.0), hot, hot, hot], [0, 7, 42, 9], [0, 5, 5, 5])
    assert batched[2] == alone[0]


def test_different_steps_draw_different_tokens():
    logits = torch.zeros(1, 1000)
    tokens = {sample(logits, [SamplingParams(temperature=1.0)], [3], [step]).item() for step in range(20)}
    assert len(tokens) > 10


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = random_logits(2)
    for params in (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        for seed in range(10):
            assert sample(logits, [params] * 2, [seed] * 2, [0, 0]).tolist() == logits.argmax(-1).tolist()


def test_top_k_never_picks_outside_the_k_best():
    logits = random_logits(1, vocab=100)
    allowed = set(logits[0].topk(5).indices.tolist())
    for seed in range(50):
        token = sample(logits, [SamplingParams(temperature=5.0, top_k=5)], [seed], [0]).item()
        assert token in allowed


def word_tokenizer(words: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def test_incremental_text_matches_full_decode():
    tokenizer = word_tokenizer(["<unk>", "hello", "big", "world", "again"])
    detok = IncrementalDetokenizer(tokenizer, stop=())
    ids = [1, 2, 3, 4, 1]
    for token in ids:
        assert not detok.append(token)
    assert detok.text == tokenizer.decode(ids)


def test_stop_string_cuts_the_text_before_it():
    tokenizer = word_tokenizer(["<unk>", "hello", "big", "world", "again"])
    detok = IncrementalDetokenizer(tokenizer, stop=("world",))
    assert not detok.append(1)
    assert not detok.append(2)
    assert detok.append(3)
    assert detok.text == "hello big "
