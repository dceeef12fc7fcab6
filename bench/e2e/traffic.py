"""Request plans: open-loop Poisson arrivals, Zipf(α) adapter choice, fixed prompt and output lengths.

A plan is drawn from a seed before the run starts, so the base-only and adapter runs at one
offered load share their arrival times and prompts, and the engine-alone replay can send the very
requests the stack served.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from bench.e2e.assets import BenchAdapter, special_ids, tenant_name, token_word


class Mode(StrEnum):
    ZIPF = "zipf"  # every request names an adapter, Zipf(α) over all of them
    BASE = "base"  # no adapter: the base model alone


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    at_s: float  # arrival, seconds after the run's start
    tenant: str
    adapter: str | None
    prompt_token_ids: tuple[int, ...]  # BOS first: what the engine sees
    max_tokens: int

    @property
    def prompt_text(self) -> str:
        """The prompt as the gateway receives it (its tokenizer adds the BOS back)."""
        return " ".join(token_word(token) for token in self.prompt_token_ids[1:])


def zipf_weights(count: int, alpha: float) -> list[float]:
    """P(rank k) ∝ 1 / k^α for k = 1..count, normalised."""
    raw = [rank**-alpha for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True, slots=True)
class TrafficShape:
    mode: Mode
    adapters: list[BenchAdapter]  # in popularity order
    num_tenants: int
    zipf_alpha: float
    vocab_size: int
    prompt_tokens: int
    output_tokens: int


class RequestSource:
    """An endless stream of requests of one traffic shape (arrival times are the caller's)."""

    def __init__(self, shape: TrafficShape, seed: int) -> None:
        self.shape = shape
        self._rng = random.Random(seed)
        self._weights = zipf_weights(len(shape.adapters), shape.zipf_alpha)
        self._bos, _ = special_ids(shape.vocab_size)

    def draw(self, index: int, at_s: float, adapter: BenchAdapter | None = None) -> PlannedRequest:
        """The next request; in Zipf mode for `adapter` when given, else for a Zipf draw."""
        shape, rng = self.shape, self._rng
        if shape.mode is Mode.ZIPF:
            adapter = adapter or rng.choices(shape.adapters, weights=self._weights)[0]
            tenant, adapter_name = adapter.tenant, adapter.name
        else:
            tenant, adapter_name = tenant_name(rng.randrange(shape.num_tenants)), None
        words = [rng.randrange(self._bos) for _ in range(shape.prompt_tokens - 1)]  # any id but the specials
        return PlannedRequest(index, at_s, tenant, adapter_name, (self._bos, *words), shape.output_tokens)

    def endless(self) -> Iterator[PlannedRequest]:
        index = 0
        while True:
            yield self.draw(index, 0.0)
            index += 1


def poisson_plan(shape: TrafficShape, rate_per_s: float, duration_s: float, seed: int) -> list[PlannedRequest]:
    """Requests arriving as a Poisson process of `rate_per_s` over `duration_s`. The arrival times
    depend on (rate, duration, seed) only, not on the mode, so two modes' plans arrive together."""
    clock = random.Random(seed)
    source = RequestSource(shape, seed + 1)
    plan: list[PlannedRequest] = []
    at = clock.expovariate(rate_per_s)
    while at < duration_s:
        plan.append(source.draw(len(plan), at))
        at += clock.expovariate(rate_per_s)
    return plan
