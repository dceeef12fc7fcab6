"""Sampling and detokenization."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.schema import SamplingParams
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.sampler import sample, uniform_noise


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


def test_sampled_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=1.0)] * 4000
    draws = sample(logits.expand(4000, -1), params, list(range(4000)), [0] * 4000)
    frequencies = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(frequencies, logits.softmax(-1)[0], atol=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_its_mass():
    # probabilities ≈ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps the first two only
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.8)] * 500
    draws = sample(logits.expand(500, -1), params, list(range(500)), [0] * 500)
    assert set(draws.tolist()) == {0, 1}


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    tokens = sample(logits, params, [1, 2, 3], [0, 0, 0])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_noise_is_a_uniform_function_of_seed_step_and_index():
    seeds = torch.tensor([5, 5, 6, (1 << 62) + 5])
    noise = uniform_noise(seeds, torch.tensor([0, 1, 0, 0]), 20000)
    assert torch.equal(noise, uniform_noise(seeds, torch.tensor([0, 1, 0, 0]), 20000))
    assert noise.min() > 0 and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.01
    for a, b in ((0, 1), (0, 2), (0, 3)):  # a different step, seed or high seed bits: another stream
        assert (noise[a] == noise[b]).float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampling_matches_cpu_and_never_syncs():
    logits = random_logits(8, vocab=1000)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9), SamplingParams(temperature=0.0)] * 4
    seeds, steps = list(range(8)), [3] * 8
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample(cuda_logits, params, seeds, steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.cpu().tolist() == sample(logits, params, seeds, steps).tolist()
