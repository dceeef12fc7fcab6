"""What goes into the engine and what comes out of it: a job's EngineRequest, its EngineResult."""

from __future__ import annotations

from dataclasses import dataclass

from shared.schema import AdapterRef, JobError, JobOutput, JobStatus, Priority, SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    job_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str = ""
    adapter: AdapterRef | None = None
    deadline: float | None = None  # unix seconds
    stream: bool = True  # hand out a TokenDelta per token (take_deltas); off, the result alone reports it
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True, slots=True)
class EngineResult:
    job_id: str
    status: JobStatus
    output: JobOutput | None = None
    error: JobError | None = None
    completion_tokens: int = 0
    # when the request went through the engine, unix seconds (0: not reached): taken in (`add`), its first
    # token read from a step, and its end (its last token's step, or the failure)
    added_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0

    @property
    def first_token_ms(self) -> int:
        return int(self.first_token_at * 1000)
