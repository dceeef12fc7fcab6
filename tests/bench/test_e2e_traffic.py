"""bench/e2e's request plans and assets: Zipf choice, shared arrivals, prompts that tokenize exactly."""

from __future__ import annotations

import itertools
from collections import Counter

from bench.e2e.assets import BenchAdapter, adapter_specs, special_ids, word_tokenizer
from bench.e2e.presets import PRESETS
from bench.e2e.traffic import Mode, RequestSource, TrafficShape, poisson_plan, zipf_weights

PRESET = PRESETS["tiny"]


def shape(mode: Mode, adapters: list[BenchAdapter]) -> TrafficShape:
    return TrafficShape(mode, adapters, PRESET.num_tenants, 1.0, PRESET.vocab_size, 10, 4)


def test_zipf_weights_fall_as_one_over_rank_and_sum_to_one():
    weights = zipf_weights(100, 1.0)
    assert abs(sum(weights) - 1.0) < 1e-12
    assert weights[0] / weights[9] == 10.0  # rank 1 is ten times as likely as rank 10
    assert all(a > b for a, b in itertools.pairwise(weights))


def test_zipf_traffic_follows_the_weights_and_every_tenant_owns_hot_and_cold_adapters():
    adapters = adapter_specs(PRESETS["llama3-8b"])  # 100 adapters over 4 tenants, hottest first
    source = RequestSource(shape(Mode.ZIPF, adapters), seed=3)
    counts = Counter(source.draw(i, 0.0).adapter for i in range(20_000))
    share = counts["zipf-001"] / 20_000
    assert abs(share - zipf_weights(100, 1.0)[0]) < 0.01  # ≈ 0.193
    assert counts["zipf-001"] > counts["zipf-010"] > counts["zipf-100"]
    assert {adapter.tenant for adapter in adapters[:4]} == {"tenant0", "tenant1", "tenant2", "tenant3"}
    assert {adapter.tenant for adapter in adapters[-4:]} == {"tenant0", "tenant1", "tenant2", "tenant3"}


def test_base_and_zipf_plans_at_one_load_arrive_together():
    adapters = adapter_specs(PRESET)
    base = poisson_plan(shape(Mode.BASE, adapters), 50.0, 4.0, seed=7)
    zipf = poisson_plan(shape(Mode.ZIPF, adapters), 50.0, 4.0, seed=7)
    assert [r.at_s for r in base] == [r.at_s for r in zipf]
    assert 120 < len(base) < 280  # Poisson(200)
    assert all(r.adapter is None for r in base) and all(r.adapter is not None for r in zipf)


def test_a_prompts_text_tokenizes_to_its_token_ids():
    tokenizer = word_tokenizer(PRESET.vocab_size)
    bos, eos = special_ids(PRESET.vocab_size)
    for request in poisson_plan(shape(Mode.BASE, adapter_specs(PRESET)), 20.0, 1.0, seed=1):
        assert tokenizer.encode(request.prompt_text).ids == list(request.prompt_token_ids)
        assert request.prompt_token_ids[0] == bos and eos not in request.prompt_token_ids
        assert len(request.prompt_token_ids) == 10
