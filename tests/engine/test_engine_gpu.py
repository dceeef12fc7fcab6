"""The engine on a CUDA GPU (Triton attention, GPU sampling) against transformers + PEFT and the CPU path."""

from __future__ import annotations

import time

import pytest
import torch

from tests.engine.engines import write_adapters
from tests.engine.test_engine_generation import (
    PROMPTS,
    assert_matches_oracle,
    greedy_request,
    make_engine,
    prefill_logits,
    run_to_completion,
)
from tests.engine.tiny_hf import TinyCheckpoint
from tests.kernels.lora_cases import rel_err
from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("budget", [2048, 5])
def test_fp32_greedy_tokens_equal_the_oracle(llama: TinyCheckpoint, budget: int):
    engine = make_engine(llama, device="cuda", dtype="float32", max_num_batched_tokens=budget)
    jobs = {f"job-{name}": name for name in PROMPTS}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert_matches_oracle(llama, results, jobs)


def test_bf16_prefill_logits_are_within_bf16_tolerance_of_fp32_cpu(llama: TinyCheckpoint):
    on_gpu = prefill_logits(llama, PROMPTS, device="cuda", dtype="bfloat16")
    assert rel_err(on_gpu, prefill_logits(llama, PROMPTS, device="cpu", dtype="float32")) < 2e-2


BLOCK_SIZE = 4
ADAPTER_SLOTS = {"all_r8": 0, "attn_r4_rslora": 1, "mlp_k_r4": 2}


def graph_runner(checkpoint: TinyCheckpoint) -> ModelRunner:
    """fp32 runner whose decode graphs cover 1, 2, 4 and 8 sequences, adapters loaded per ADAPTER_SLOTS."""
    runner = make_engine(checkpoint, device="cuda", dtype="float32", max_num_seqs=8, block_size=BLOCK_SIZE).runner
    write_adapters(runner.model, {(slot,): checkpoint.adapters[name] for name, slot in ADAPTER_SLOTS.items()})
    return runner


def prefilled(runner: ModelRunner, num_seqs: int) -> list[Sequence]:
    """num_seqs sequences whose prompts are cached (one eager prefill step), each with one output
    token waiting to be decoded at position len(prompt)."""
    blocks = BlockManager(runner.num_blocks, BLOCK_SIZE)
    prompts = list(PROMPTS.values())
    seqs = []
    for i in range(num_seqs):
        prompt = prompts[i % len(prompts)][i // len(prompts) :]
        seq = Sequence(seq_id=str(i), prompt_token_ids=list(prompt), sampling=None, seed=0)
        blocks.allocate(seq, len(prompt) + 1)
        seqs.append(seq)
    runner.execute([ScheduledSequence(s, len(s.prompt_token_ids)) for s in seqs], lambda uid: None, BLOCK_SIZE)
    for seq in seqs:
        seq.num_computed_tokens = len(seq.prompt_token_ids)
        seq.output_token_ids.append(7)
    return seqs


def decode_logits(runner: ModelRunner, seqs: list[Sequence], slots: list[int], *, eager: bool) -> torch.Tensor:
    """Logits [n, V] of one decode step of `seqs` with adapter slot slots[i] (-1: base) for seqs[i]."""
    for seq, slot in zip(seqs, slots, strict=True):
        seq.adapter_uid = None if slot < 0 else str(slot)
    graphs = runner.graphs
    if eager:
        runner.graphs = None
    try:
        return runner.execute([ScheduledSequence(s, 1) for s in seqs], int, BLOCK_SIZE).clone()
    finally:
        runner.graphs = graphs


def assert_graph_matches_eager(runner: ModelRunner, seqs: list[Sequence], slots: list[int]) -> torch.Tensor:
    graph = decode_logits(runner, seqs, slots, eager=False)
    eager = decode_logits(runner, seqs, slots, eager=True)
    torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))
    return graph


@pytest.mark.parametrize("num_requests", [3, 7])
def test_graph_decode_greedy_tokens_equal_the_oracle_for_padded_batches(
    llama: TinyCheckpoint, num_requests: int, monkeypatch: pytest.MonkeyPatch
):
    engine = make_engine(llama, device="cuda", dtype="float32", max_num_seqs=8)
    graphs = engine.runner.graphs
    replayed: list[int] = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda **step: replayed.append(len(step["token_ids"])) or run(**step))
    names = list(PROMPTS)
    # adapters resident first, so the batch is admitted in one step (the engine paces later admissions)
    run_to_completion(engine, [greedy_request(llama, f"warm-{name}", name) for name in names])
    jobs = {f"job-{i}": names[i % len(names)] for i in range(num_requests)}
    results = run_to_completion(engine, [greedy_request(llama, job, adapter) for job, adapter in jobs.items()])
    assert_matches_oracle(llama, results, jobs)
    assert num_requests in replayed  # decode steps of 3 (7) sequences ran on the graph of 4 (8)


@pytest.mark.parametrize(
    "assignments",
    [
        [[0, 1, 2, -1, 0], [2, -1, 1, 0, 2], [1, 1, 1, 1, 1], [-1, -1, -1, -1, -1]],
        [[-1, 2, -1], [0, 0, 0], [2, 1, 0]],
    ],
    ids=["5-of-8", "3-of-4"],
)
def test_graph_decode_equals_eager_whatever_the_token_to_slot_assignment(
    llama: TinyCheckpoint, assignments: list[list[int]]
):
    runner = graph_runner(llama)
    seqs = prefilled(runner, len(assignments[0]))
    for slots in assignments:  # replays of the same captured graphs, each with its own assignment
        assert_graph_matches_eager(runner, seqs, slots)


def test_graph_decode_sees_an_adapter_reloaded_into_its_slot(llama: TinyCheckpoint):
    runner = graph_runner(llama)
    seqs = prefilled(runner, 5)
    slots = [0, -1, 0, 1, 0]
    before = assert_graph_matches_eager(runner, seqs, slots)
    write_adapters(runner.model, {(0,): llama.adapters["attn_r4_rslora"]})  # slot 0: all_r8 → another's weights
    after = assert_graph_matches_eager(runner, seqs, slots)
    changed = (after - before).abs().amax(-1) > 1e-4
    assert changed.tolist() == [True, False, True, False, True]


def test_graph_padding_rows_write_only_the_scratch_block(llama: TinyCheckpoint):
    runner = graph_runner(llama)
    seqs = prefilled(runner, 5)  # padded to 8: three rows of padding
    caches = runner.kv_cache.key + runner.kv_cache.value
    before = [cache.clone() for cache in caches]
    decode_logits(runner, seqs, [0, -1, 1, 2, -1], eager=False)
    real_slots = {
        s.block_table[s.num_computed_tokens // BLOCK_SIZE] * BLOCK_SIZE + s.num_computed_tokens % BLOCK_SIZE
        for s in seqs
    }
    scratch = runner.graphs.scratch_block
    for old, new in zip(before, caches, strict=True):
        written = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # flat slots
        assert {s for s in written if s // BLOCK_SIZE != scratch} == real_slots


def test_the_device_idle_time_between_steps_is_the_hosts_delay_in_launching_the_next(llama: TinyCheckpoint):
    engine = make_engine(llama, device="cuda", dtype="float32")
    run_to_completion(engine, [greedy_request(llama, "warm-up", None)])  # kernels compiled: no slow launch
    engine.add(greedy_request(llama, "job", None))  # NEW_TOKENS steps, then one that only reads the last
    idle = []
    while engine.num_unfinished:
        engine.step()
        idle.append(engine.last_step.device_idle_s)
        if len(idle) == 4:
            torch.cuda.synchronize()  # the step in flight ends; the host launches the next 50 ms later
            time.sleep(0.05)
    # a step's idle time before it is read once it has finished, a call later; the first two steps
    # had no step in flight before them
    assert idle[:2] == [None, None]
    assert idle[5] >= 0.045
    assert all(0 <= gap < 0.045 for gap in idle[2:5] + idle[6:])
