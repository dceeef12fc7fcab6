"""The paged LoRA pool (S-LoRA's unified paging) against transformers + PEFT: adapters of more ranks
than one page holds, in pages scattered over the pool and shared in turn by adapters of other ranks,
give the oracle's logits and greedy tokens, beside lower-rank adapters and the base model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from peft import PeftModel

from shared.schema import JobStatus, SamplingParams
from tests.engine.engine_driver import BlockPool, PagedSequence, make_kv_cache, prefill
from tests.engine.engines import load_engine, load_model, write_adapters
from tests.engine.test_adapter_pool import DEVICES
from tests.engine.test_engine_generation import run_to_completion
from tests.engine.tiny_hf import (
    ALL_PROJECTIONS,
    TinyCheckpoint,
    load_oracle,
    make_tiny_model,
    oracle_greedy,
    oracle_logits,
    save_lora_adapter,
    saved_adapter_ref,
)
from worker.engine.engine_request import EngineRequest

MAX_RANK = 48  # three pages of 16 rank rows per max-rank adapter
TOLERANCE = 1e-4
ADAPTERS = {
    "wide_r24": {"rank": 24, "alpha": 12, "targets": ALL_PROJECTIONS},  # two pages, the second half full
    "deep_r40": {"rank": 40, "alpha": 40, "targets": ["q_proj", "v_proj", "down_proj"], "use_rslora": True},
    "small_r8": {"rank": 8, "alpha": 16, "targets": ["k_proj", "o_proj", "up_proj"]},
}
PROMPTS = {
    None: [5, 17, 42, 7, 99, 3],
    "wide_r24": [8, 9, 10, 11, 12, 13, 14],
    "deep_r40": [200, 3, 77, 150, 21, 9, 9, 1, 40],
    "small_r8": [1, 2, 3],
}


@dataclass(frozen=True)
class PagedCheckpoint:
    base: TinyCheckpoint  # the llama checkpoint (its model directory and info)
    adapters: dict[str, Path]
    oracle: PeftModel


@pytest.fixture(scope="module")
def paged(tiny_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> PagedCheckpoint:
    llama = tiny_checkpoints("llama")
    base = make_tiny_model("llama", seed=0)  # the weights saved in llama.model_dir
    directory = tmp_path_factory.mktemp("paged_adapters")
    adapters = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=11):
        adapters[name] = directory / name
        save_lora_adapter(base, adapters[name], seed=seed, **spec)
    return PagedCheckpoint(llama, adapters, load_oracle(base, adapters))


def test_adapters_in_scattered_pages_give_the_oracles_logits(paged: PagedCheckpoint) -> None:
    model = load_model(paged.base.model_dir, paged.base.info, max_loras=3, max_lora_rank=MAX_RANK)
    assert (model.page_rank, model.pages_per_slot, model.num_pages) == (16, 3, 9)
    # pages out of order and apart; the small adapter's page sits between the others'
    pages = {"wide_r24": (7, 2), "deep_r40": (4, 8, 0), "small_r8": (5,)}
    write_adapters(model, {pages[name]: paged.adapters[name] for name in pages})
    slots = {name: pages[name][0] for name in pages}
    seqs = [(name, PagedSequence(list(prompt), slot=slots.get(name, -1))) for name, prompt in PROMPTS.items()]
    kv_cache = make_kv_cache(model, num_blocks=64, block_size=4)

    logits = prefill([seq for _, seq in seqs], model, kv_cache, BlockPool(64))

    for row, (name, seq) in enumerate(seqs):
        expected = oracle_logits(paged.oracle, seq.token_ids, name)[-1]
        assert (logits[row] - expected).abs().max() <= TOLERANCE, name


@pytest.mark.parametrize("device", DEVICES)
def test_the_pool_cycles_adapters_of_mixed_ranks_through_too_few_pages_and_matches_the_oracle(
    paged: PagedCheckpoint, device: str
) -> None:
    # one max-rank adapter's worth of pages (3): every adapter evicts others' pages to load; on CUDA
    # the Triton kernels read them (fp32: greedy tokens equal the oracle's, as in test_engine_gpu)
    root = next(iter(paged.adapters.values())).parent
    settings = {"device": device, "dtype": "float32", "max_loras": 1, "max_lora_rank": MAX_RANK}
    engine = load_engine(paged.base.model_dir, root, name="llama", num_kv_blocks=64, block_size=4, **settings)
    order = ["wide_r24", "small_r8", "deep_r40", "small_r8", "wide_r24", None, "deep_r40"]

    for index, name in enumerate(order):
        ref = None
        if name is not None:
            directory = paged.adapters[name]
            ref = saved_adapter_ref(name, directory)
        sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        request = EngineRequest(f"job-{index}", tuple(PROMPTS[name]), sampling, adapter=ref)
        result = run_to_completion(engine, [request])[request.job_id]

        assert result.status is JobStatus.SUCCEEDED, result.error
        assert list(result.output.token_ids) == oracle_greedy(paged.oracle, PROMPTS[name], name, 5), (index, name)
    assert engine.adapter_pool.gpu.free_pages <= 3
