"""One step's inputs as plain host lists: what the runner turns into device tensors (a ForwardBatch,
or a decode graph's static buffers), and what a tensor-parallel rank 0 sends its followers so that
every rank runs the same step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence as SequenceState


def _token_at(seq: SequenceState, position: int) -> int:
    """The token at `position` of prompt + output, without concatenating the two lists."""
    prompt_len = len(seq.prompt_token_ids)
    return seq.prompt_token_ids[position] if position < prompt_len else seq.output_token_ids[position - prompt_len]


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: list[int]  # [T]; -(r + 1): row r of the tokens the previous step sampled (on the device)
    positions: list[int]  # [T] position of each token in its sequence
    slot_mapping: list[int]  # [T] flat KV cache slot of each token
    token_slots: list[int]  # [T] adapter slot of each token, -1: the base model
    query_start: list[int]  # [B + 1] cumulative new-token counts per sequence
    block_tables: list[list[int]]  # [B] each sequence's KV blocks (unpadded; its own list: read, never kept)

    @classmethod
    def of(
        cls, scheduled: Sequence[ScheduledSequence], slot_of: Callable[[str], int | None], block_size: int
    ) -> StepInputs:
        if all(item.num_new_tokens == 1 for item in scheduled):
            return cls._decode(scheduled, slot_of, block_size)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        query_start = [0]
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += [_token_at(seq, start)] if item.num_new_tokens == 1 else seq.token_ids(start, end)
            positions += range(start, end)
            slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            adapter_slot = -1 if seq.adapter_uid is None else slot_of(seq.adapter_uid)
            token_slots += [adapter_slot] * item.num_new_tokens
            query_start.append(query_start[-1] + item.num_new_tokens)
        tables = [item.seq.block_table for item in scheduled]
        return cls(input_ids, positions, slots, token_slots, query_start, tables)

    @classmethod
    def _decode(
        cls, scheduled: Sequence[ScheduledSequence], slot_of: Callable[[str], int | None], block_size: int
    ) -> StepInputs:
        """`of` for a step of one token per sequence, the engine's most frequent: a few comprehensions."""
        seqs = [item.seq for item in scheduled]
        positions = [seq.num_computed_tokens for seq in seqs]
        return cls(
            input_ids=[_token_at(seq, p) for seq, p in zip(seqs, positions, strict=True)],
            positions=positions,
            slot_mapping=[
                seq.block_table[p // block_size] * block_size + p % block_size
                for seq, p in zip(seqs, positions, strict=True)
            ],
            token_slots=[-1 if seq.adapter_uid is None else slot_of(seq.adapter_uid) for seq in seqs],
            query_start=list(range(len(seqs) + 1)),
            block_tables=[seq.block_table for seq in seqs],
        )

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings one token."""
        return len(self.input_ids) == self.num_seqs

    @property
    def context_lens(self) -> list[int]:
        """[B] tokens each sequence has in the cache after this step: its last new token's position + 1."""
        return [self.positions[end - 1] + 1 for end in self.query_start[1:]]
