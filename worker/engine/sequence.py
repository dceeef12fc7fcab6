"""One request's state inside the engine (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from shared.schema import FinishReason, Priority, SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued for admission, or preempted and waiting to be recomputed
    RUNNING = auto()  # holds KV blocks (and its adapter's slot) and is scheduled every step
    FINISHED = auto()


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # the request's seed, or one drawn at arrival: sampling is reproducible per request
    tenant: str = ""
    adapter_uid: str | None = None
    priority: Priority = Priority.INTERACTIVE
    arrival: float = 0.0  # monotonic seconds; earlier arrivals are scheduled first and preempted last
    overtaken: int = 0  # later arrivals admitted ahead of it for their adapter (scheduler.py: grouping)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
