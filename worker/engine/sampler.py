"""Token selection: greedy, or temperature / top-k / top-p sampling with per-request seeds.

Randomness for a request's n-th output token comes from a generator seeded with (seed, n), so a
request's output depends only on its own seed and logits: not on which other requests share the
batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.schema import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, step) pairs over the seed space
_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, step: int) -> int:
    return (seed * _SEED_MIX + step) & _SEED_MASK


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
) -> torch.Tensor:
    """Pick one token per row of logits [B, V] (float32). Returns int64 [B] on logits' device."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, device=logits.device)
    temperature = torch.tensor([params[i].temperature for i in sampled_rows], device=logits.device)
    scaled = logits[rows] / temperature.unsqueeze(1)

    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    top_k = torch.tensor([params[i].top_k or vocab for i in sampled_rows], device=logits.device)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    top_p = torch.tensor([params[i].top_p for i in sampled_rows], device=logits.device)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)

    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one seeded generator per row
    noise = torch.empty_like(sorted_probs)
    for row, i in enumerate(sampled_rows):
        generator = torch.Generator(device=logits.device).manual_seed(step_seed(seeds[i], steps[i]))
        noise[row].exponential_(generator=generator)
    choice = (sorted_probs / noise).argmax(dim=-1)
    tokens[rows] = sorted_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    return tokens
