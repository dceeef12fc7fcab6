"""Token selection: greedy, or temperature / top-k / top-p sampling with per-request seeds, batched
on the logits' device without a host sync.

Randomness is counter-based: the uniform for vocabulary entry v of a request's n-th output token is
a hash of (seed, n, v), so a request's output depends only on its own seed, n and logits: not on
which other requests share the batch, nor on whether it was preempted and recomputed. A token is
drawn by the Gumbel-max race, argmax(logits / T - log(-log u)), over the entries top-k / top-p keep.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.schema import SamplingParams

_MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2^27: a product with a 32-bit value stays inside int64, on every device
_GOLDEN32 = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 x in [0, 2^32) (two xor-shift-multiply rounds)."""
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, vocab] uniforms in (0, 1), one per (seed, step, vocab index).

    seeds int64 [B] (any 63-bit value), steps int64 [B]: pure functions of the three counters."""
    seed_lo, seed_hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row_key = _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) ^ (steps & _MASK32))  # [B]
    index = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row_key[:, None] ^ _mix32((index * _GOLDEN32) & _MASK32)[None, :])  # [B, vocab]
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exactly representable in float32


def _keep_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [B, V]: the entries top-k (int64 [B], V for off) and then top-p (float32 [B]) keep."""
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = (rank < top_k.unsqueeze(1)) & (mass_before < top_p.unsqueeze(1))
    return torch.empty_like(keep_sorted).scatter_(1, sorted_ids, keep_sorted)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
) -> torch.Tensor:
    """Pick one token per row of logits [B, V] (float32). Returns int64 [B] on logits' device.

    Per-row settings travel to the device as small tensors (pinned, non-blocking on CUDA); nothing
    here waits for the device."""
    greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_tokens
    vocab = logits.shape[-1]
    pin = logits.is_cuda

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(logits.device, non_blocking=True)

    greedy = tensor([p.greedy for p in params], torch.bool)
    # greedy rows run through the sampling arithmetic too (temperature 1), then take the argmax
    temperature = tensor([1.0 if p.greedy else p.temperature for p in params], torch.float32)
    scaled = logits / temperature.unsqueeze(1)
    if any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0) for p in params):
        top_k = tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64)
        top_p = tensor([p.top_p for p in params], torch.float32)
        scaled = scaled.masked_fill(~_keep_mask(scaled, top_k, top_p), float("-inf"))
    noise = uniform_noise(tensor(list(seeds), torch.int64), tensor(list(steps), torch.int64), vocab)
    sampled = (scaled - torch.log(-torch.log(noise))).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)
