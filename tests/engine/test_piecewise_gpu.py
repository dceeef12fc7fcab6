"""Piecewise CUDA graphs of steps with prefill chunks: replays against the same steps run eagerly,
over several adapter assignments and buckets, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engines import write_adapters
from tests.engine.test_engine_generation import PROMPTS, make_engine
from tests.engine.test_engine_gpu import ADAPTER_SLOTS, BLOCK_SIZE
from tests.engine.tiny_hf import TinyCheckpoint
from tests.kernels.lora_cases import rel_err
from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def runner_for(checkpoint: TinyCheckpoint, dtype: str) -> ModelRunner:
    runner = make_engine(
        checkpoint, device="cuda", dtype=dtype, max_num_seqs=8, max_num_batched_tokens=96, block_size=BLOCK_SIZE
    ).runner
    write_adapters(runner.model, {(slot,): checkpoint.adapters[name] for name, slot in ADAPTER_SLOTS.items()})
    return runner


class MixedStep:
    """Every prompt of PROMPTS (repeated `copies` times) prefilled whole beside one decode token of
    each of two sequences prefilled before: a step of prefill chunks and decodes."""

    def __init__(self, runner: ModelRunner, copies: int) -> None:
        self.runner = runner
        blocks = BlockManager(runner.num_blocks, BLOCK_SIZE)
        prompts = list(PROMPTS.values()) * copies
        self.decoding = [Sequence(seq_id=f"d{i}", prompt_token_ids=list(p), sampling=None, seed=0)
                         for i, p in enumerate(prompts[:2])]  # fmt: skip
        for seq in self.decoding:
            blocks.allocate(seq, len(seq.prompt_token_ids) + 1)
        runner.execute([ScheduledSequence(s, len(s.prompt_token_ids)) for s in self.decoding], int, BLOCK_SIZE)
        for seq in self.decoding:
            seq.num_computed_tokens = len(seq.prompt_token_ids)
            seq.output_token_ids.append(7)
        self.fresh = [Sequence(seq_id=f"p{i}", prompt_token_ids=list(p), sampling=None, seed=0)
                      for i, p in enumerate(prompts)]  # fmt: skip
        for seq in self.fresh:
            blocks.allocate(seq, len(seq.prompt_token_ids))

    @property
    def num_tokens(self) -> int:
        return sum(len(s.prompt_token_ids) for s in self.fresh) + len(self.decoding)

    def logits(self, adapter_slots: list[int], *, piecewise: bool) -> torch.Tensor:
        """adapter_slots[i] (-1: base) for the i-th sequence, prefilling ones first."""
        seqs = self.fresh + self.decoding
        for seq, slot in zip(seqs, adapter_slots, strict=True):
            seq.adapter_uid = None if slot < 0 else str(slot)
        scheduled = [ScheduledSequence(s, len(s.prompt_token_ids)) for s in self.fresh]
        scheduled += [ScheduledSequence(s, 1) for s in self.decoding]
        kept = self.runner.piecewise
        if not piecewise:
            self.runner.piecewise = None
        try:
            return self.runner.execute(scheduled, int, BLOCK_SIZE).clone()
        finally:
            self.runner.piecewise = kept


def slots_for(num_seqs: int, pattern: list[int]) -> list[int]:
    return [pattern[i % len(pattern)] for i in range(num_seqs)]


@pytest.mark.parametrize("pattern", [[0, 1, 2, -1], [-1], [2, 2, -1, 1]], ids=["mixed", "base", "regrouped"])
def test_a_piecewise_step_equals_the_eager_step(llama: TinyCheckpoint, pattern: list[int]):
    runner = runner_for(llama, "float32")
    step = MixedStep(runner, copies=1)
    replayed = []
    run = runner.piecewise.run
    runner.piecewise.run = lambda batch, slots: replayed.append(batch.num_tokens) or run(batch, slots)
    adapter_slots = slots_for(len(PROMPTS) + 2, pattern)
    graphs = step.logits(adapter_slots, piecewise=True)
    eager = step.logits(adapter_slots, piecewise=False)
    assert replayed == [step.num_tokens], "the step did not replay the piecewise graphs"
    torch.testing.assert_close(graphs, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(graphs.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_piecewise_steps_of_several_buckets_match_eager_in_bf16(llama: TinyCheckpoint, copies: int):
    runner = runner_for(llama, "bfloat16")
    step = MixedStep(runner, copies)
    assert step.num_tokens <= runner.piecewise.max_tokens
    adapter_slots = slots_for(len(PROMPTS) * copies + 2, [0, -1, 1, 2])
    graphs = step.logits(adapter_slots, piecewise=True)
    eager = step.logits(adapter_slots, piecewise=False)
    assert rel_err(graphs, eager) < 1e-2
