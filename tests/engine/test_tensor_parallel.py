"""A tensor-parallel engine (2 ranks: this process and a follower it starts, gloo on CPU) against the
one-process engine: the same logits, fp32, for a mixed batch of the base model and adapters over a
prefill, a decode step, and a step mixing a new prompt's prefill with decodes; dense and MoE models,
adapters loaded through rank 0's pool and written by every rank into the pages it chose."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.schema import SamplingParams
from tests.engine.engines import host_adapter, load_engine, load_model, tensor_parallel_engine
from tests.engine.fp8_oracle import save_fp8_checkpoint
from tests.engine.tiny_hf import ADAPTERS, TinyCheckpoint, save_lora_adapter, save_tiny_model, saved_adapter_ref
from tests.engine.tiny_moe import MOE_FAMILIES, TinyMoE, build_tiny_moe
from worker.adapter_pool.host_adapter import fresh_buffers
from worker.adapter_pool.rank_adapter import shard_adapter
from worker.engine.engine import LLMEngine
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence
from worker.model.parallel.group import TensorParallel
from worker.model.parallel.sharding import ModelShard

TOLERANCE = 1e-4
ENGINE = {"max_loras": 4, "max_lora_rank": 8, "max_num_seqs": 8, "num_kv_blocks": 64}
BLOCKS_PER_SEQ = 8  # of 16 tokens: each sequence its own blocks, far apart


def bring_adapters(engine: LLMEngine, adapters: dict[str, Path]) -> dict[str | None, str | None]:
    """Every adapter into the engine's device pages, through its pool (as a request for it would);
    name → uid (None → None: the base model)."""
    pool = engine.adapter_pool
    refs = [saved_adapter_ref(name, directory) for name, directory in adapters.items()]
    for ref in refs:
        pool.request(ref)
    for _ in range(200):
        failures = pool.poll()
        assert not failures
        if all(engine.adapter_slots.slot_of(ref.uid) is not None for ref in refs):
            return {None: None} | {ref.name: ref.uid for ref in refs}
        pool.wait(0.05)
    raise AssertionError("adapters did not land in the pool")


def run_steps(
    engine: LLMEngine,
    uids: dict[str | None, str | None],
    prompts: dict[str | None, list[int]],
    late: tuple[str | None, list[int]],
) -> list[torch.Tensor]:
    """Logits float32 [B, V] of three steps: every prompt's prefill (adapter name → prompt; None:
    the base model); a decode of each; a decode of each beside the prefill of `late`. Greedy tokens
    are fed back as the engine feeds them."""
    greedy = SamplingParams(temperature=0.0)

    def sequence(index: int, name: str | None, prompt: list[int]) -> Sequence:
        blocks = list(range(index * BLOCKS_PER_SEQ, (index + 1) * BLOCKS_PER_SEQ))
        return Sequence(f"s{index}", list(prompt), greedy, seed=index, adapter_uid=uids[name], block_table=blocks)

    seqs = [sequence(index, name, prompt) for index, (name, prompt) in enumerate(prompts.items())]
    newcomer = sequence(len(seqs), *late)
    steps = [
        [ScheduledSequence(seq, seq.num_tokens) for seq in seqs],
        [ScheduledSequence(seq, 1) for seq in seqs],
        [ScheduledSequence(seq, 1) for seq in seqs] + [ScheduledSequence(newcomer, newcomer.num_tokens)],
    ]
    runner, logits = engine.runner, []
    for scheduled in steps:
        step_logits = runner.execute(scheduled, engine.adapter_slots.slot_of, engine.blocks.block_size)
        logits.append(step_logits.clone())
        tokens, _ = runner.sample(step_logits, scheduled).wait()
        for item, token in zip(scheduled, tokens, strict=True):
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.output_token_ids.append(token)
    return logits


def test_an_adapters_rank_parts_tile_it(llama: TinyCheckpoint):
    model = load_model(llama.model_dir, llama.info)
    whole = host_adapter(llama.adapters["all_r8"], model)
    shards = [ModelShard.of(llama.info, TensorParallel(rank, 2)) for rank in range(2)]
    parts = [shard_adapter(whole, shard, take=fresh_buffers(pin=False)) for shard in shards]
    for index, part in enumerate(whole.parts):
        a = [p.a(p.parts[index]) for p in parts]  # [r, in_rank]
        b = [p.b(p.parts[index]) for p in parts]  # [out_rank, r]
        if part.projection in ("o_proj", "down_proj"):  # row-parallel: A split by input, B whole
            torch.testing.assert_close(torch.cat(a, dim=1), whole.a(part), rtol=0, atol=0)
            assert all(torch.equal(x, whole.b(part)) for x in b)
        else:  # column-parallel: A whole, B split by output (k and v: each rank its KV head)
            assert all(torch.equal(x, whole.a(part)) for x in a)
            torch.testing.assert_close(torch.cat(b, dim=0), whole.b(part), rtol=0, atol=0)


PROMPTS = ([5, 17, 42, 7, 99, 3], [8, 9, 10, 11, 12], [200, 3, 77, 150, 21, 9, 9])
LATE_PROMPT = [1, 2, 3, 250]


def mixed_batch(engine: LLMEngine, adapters: dict[str, Path], names: list[str]) -> list[torch.Tensor]:
    """run_steps' logits: the base model beside names[0] and names[1], names[2] joining late."""
    uids = bring_adapters(engine, {name: adapters[name] for name in names})
    prompts = dict(zip((None, *names[:2]), PROMPTS, strict=True))
    return run_steps(engine, uids, prompts, (names[2], LATE_PROMPT))


def one_and_two_ranks(
    model_dir: Path,
    adapters: dict[str, Path],
    names: list[str],
    scenario: Callable[[LLMEngine, dict[str, Path], list[str]], list[torch.Tensor]] = mixed_batch,
    **engine: object,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """scenario(engine, adapters, names)'s logits on a one-process engine and on a two-rank engine
    (EngineConfig(**engine)), in that order."""
    root = next(iter(adapters.values())).parent
    settings = ENGINE | engine
    single = load_engine(model_dir, root, **settings)
    expected = scenario(single, adapters, names)
    with tensor_parallel_engine(model_dir, root, tensor_parallel=2, **settings) as parallel:
        assert parallel.runner.model.local_info.num_heads == single.info.num_heads // 2
        got = scenario(parallel, adapters, names)
    return expected, got


def assert_tensor_parallel_matches(
    model_dir: Path, adapters: dict[str, Path], names: list[str], scenario=mixed_batch, **engine: object
) -> None:
    expected, got = one_and_two_ranks(model_dir, adapters, names, scenario, device="cpu", dtype="float32", **engine)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        torch.testing.assert_close(have, want, atol=TOLERANCE, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")


DENSE_ADAPTERS = ["all_r8", "attn_r4_rslora", "mlp_k_r4"]
MOE_ADAPTERS = ["experts_r8", "attn_r4", "fused_r4_rslora"]


def test_dense_tensor_parallel_logits_equal_one_process(llama: TinyCheckpoint) -> None:
    assert_tensor_parallel_matches(llama.model_dir, llama.adapters, DENSE_ADAPTERS)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_tensor_parallel_logits_equal_one_process(family: str, tmp_path: Path) -> None:
    moe: TinyMoE = build_tiny_moe(family, tmp_path)
    assert_tensor_parallel_matches(moe.model_dir, moe.adapters, MOE_ADAPTERS)


@pytest.mark.parametrize(
    ("family", "shape"),
    [
        ("qwen2", {}),  # q/k/v biases, split with their rows; a tied embedding and head
        ("llama", {"attention_bias": True, "vocab_size": 301}),  # o's bias once, not per rank; a padded vocab share
    ],
)
def test_one_kv_head_for_two_ranks_is_replicated(family: str, shape: dict, tmp_path: Path) -> None:
    """Multi-query attention: each rank holds a copy of the one KV head its query heads read."""
    base = save_tiny_model(family, tmp_path / "model", seed=3, num_key_value_heads=1, **shape)
    adapters = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        adapters[name] = tmp_path / name
        save_lora_adapter(base, adapters[name], seed=seed, **spec)
    assert_tensor_parallel_matches(tmp_path / "model", adapters, DENSE_ADAPTERS)


def evict_then_mix(engine: LLMEngine, adapters: dict[str, Path], names: list[str]) -> list[torch.Tensor]:
    """A pool of two: names[0] and names[1] serve, names[0] is released, and names[2] is loaded over
    the pages rank 0's pool evicts for it (names[0]'s, the only evictable: both engines compared
    evict the same); then the base, names[2] and names[1] serve together."""
    before = mixed_batch(engine, adapters, [names[0], names[1], names[1]])
    pool = engine.adapter_pool
    evicted, kept = (saved_adapter_ref(name, adapters[name]).uid for name in names[:2])
    pool.drop(evicted)
    uids = bring_adapters(engine, {names[2]: adapters[names[2]]})
    assert engine.adapter_slots.slot_of(evicted) is None, "the pool of two evicted nothing"
    uids[names[1]] = kept
    prompts = dict(zip((None, names[2]), PROMPTS, strict=False))
    return before + run_steps(engine, uids, prompts, (names[1], LATE_PROMPT))


def test_an_adapter_loaded_over_an_evicted_one_lands_in_the_same_pages_on_every_rank(llama: TinyCheckpoint) -> None:
    assert_tensor_parallel_matches(llama.model_dir, llama.adapters, DENSE_ADAPTERS, evict_then_mix, max_loras=2)


def test_block_wise_fp8_weights_are_the_one_process_weights_on_every_rank(
    llama: TinyCheckpoint, tmp_path: Path
) -> None:
    """Each rank quantizes the whole dequantized weight per row and keeps its part: the row-parallel
    o and down projections' scales are their whole rows', as one process computes them."""
    model_dir = save_fp8_checkpoint(llama.model_dir, tmp_path / "fp8", method="fp8", scales="block")
    assert_tensor_parallel_matches(model_dir, llama.adapters, DENSE_ADAPTERS)


def test_each_rank_calibrates_the_fp8_kv_scales_of_its_own_kv_heads(llama: TinyCheckpoint) -> None:
    """Every rank runs the calibration's forward at once (its collectives) over its share of the heads:
    rank 0's scales are the one-process engine's for its KV heads (to the all-reduces' rounding)."""
    settings = ENGINE | {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "fp8"}
    root = next(iter(llama.adapters.values())).parent

    def scales(engine: LLMEngine) -> torch.Tensor:  # [layers, 2, local KV heads]
        return torch.stack([layer.self_attn.kv_scales for layer in engine.runner.model.model.layers])

    whole = scales(load_engine(llama.model_dir, root, **settings))
    with tensor_parallel_engine(llama.model_dir, root, tensor_parallel=2, **settings) as parallel:
        ours = scales(parallel)
        start = parallel.runner.model.shard.kv_head_start
    assert start == 0 and ours.shape[-1] == llama.info.num_kv_heads // 2
    torch.testing.assert_close(ours, whole[..., : ours.shape[-1]], rtol=TOLERANCE, atol=0)
