"""The engine: requests in, finished results out, one `step()` at a time.

Ties the scheduler (who runs), the model runner (the device work), the adapter pool (which LoRA
weights are resident; it loads the rest ahead of need) and detokenizers (text and stop strings)
together. Single-threaded: the worker calls it from its engine thread only.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from tokenizers import Tokenizer

from shared.config import EngineConfig
from shared.errors import ErrorCode, LorafleetError
from shared.schema import (
    FinishReason,
    JobError,
    JobOutput,
    JobStatus,
    Priority,
    TokenDelta,
)
from worker.adapter_pool.eviction import make_policy
from worker.adapter_pool.gpu_slots import GpuSlots
from worker.adapter_pool.pool import AdapterPool, LoadFailure
from worker.engine.admission_pacer import AdmissionPacer
from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.engine_request import EngineRequest, EngineResult
from worker.engine.model_runner import ModelRunner
from worker.engine.sampled_tokens import SampledTokens
from worker.engine.scheduler import ScheduledSequence, Scheduler
from worker.engine.sequence import Sequence
from worker.engine.step_channel import RanksOutOfStep
from worker.metrics import EngineLoad, EngineMetrics, StepStats

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Tracked:
    request: EngineRequest
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    max_tokens: int  # max_tokens capped by the room left in the model's context
    added_at: float  # unix seconds
    first_token_at: float = 0.0
    streamed_chars: int = 0  # output text already handed out in TokenDeltas


# With nothing runnable but adapter loads in flight, a step waits this long at most for one to land.
_IDLE_WAIT_S = 0.005


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A launched step whose tokens the host has not read yet. output_index: per scheduled item, the
    index in its sequence's output_token_ids that the sampled token fills (None: a prefill chunk).
    On CUDA, `started` marks the start of its device work and `follows` the end of the step in flight
    when it was launched (None: there was none): the device idled between the two, waiting for the host."""

    scheduled: list[ScheduledSequence]
    sampled: SampledTokens
    output_index: list[int | None]
    started: torch.cuda.Event | None = None
    follows: torch.cuda.Event | None = None


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: EngineConfig,
        adapter_root: Path,
        metrics: EngineMetrics,
    ) -> None:
        """The engine around `runner`; worker/switching/residency.py builds both for a worker."""
        self.runner = runner
        self.info = runner.info
        self.tokenizer = tokenizer
        self.config = config
        self.blocks = BlockManager(runner.num_blocks, config.block_size)
        self.metrics = metrics
        # None without LoRA (--max-loras 0): no host tier, no loader threads. `add` refuses requests naming
        # an adapter there, so a sequence with an adapter implies a pool
        self.adapter_pool = (
            AdapterPool(
                runner.model,
                config,
                adapter_root,
                self.metrics.adapters,
                # rank 0 of a tensor-parallel group: the followers read what its pool reads, write it where it does
                mirror=runner.channel,
            )
            if config.lora_enabled
            else None
        )
        # which adapter sits in which device slot (none without LoRA)
        self.adapter_slots = self.adapter_pool.gpu if self.adapter_pool else GpuSlots(0, make_policy("lru"))
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_manager=self.blocks,
            adapter_slots=self.adapter_slots,
            max_seqs_per_tenant=config.max_seqs_per_tenant or max(1, config.max_num_seqs // 2),
            max_overtakes=config.grouping_overtakes,
        )
        # admitting costs an eager step only where decode-only steps replay graphs (CUDA)
        self._pacer = AdmissionPacer() if runner.graphs is not None else None
        self._tracked: dict[str, _Tracked] = {}
        self._deltas: list[TokenDelta] = []
        self._in_flight: _InFlight | None = None
        self.last_step = StepStats()

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    def load(self) -> EngineLoad:
        """The queues and KV cache now, for metrics."""
        return EngineLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_blocks - self.blocks.num_free_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            preemptions=self.scheduler.num_preemptions,
            running_batch=self.scheduler.running_of(Priority.BATCH),
            waiting_batch=self.scheduler.waiting_of(Priority.BATCH),
        )

    def add(self, request: EngineRequest) -> EngineResult | None:
        """Queue a request. Returns a failed result at once if it can never run here."""
        prompt = list(request.prompt_token_ids)
        room = self.info.max_context - len(prompt)
        problem = None
        if not prompt:
            problem = LorafleetError(ErrorCode.EMPTY_PROMPT, "the prompt has no tokens")
        elif room < 1:
            problem = LorafleetError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt of {len(prompt)} tokens leaves no room in the context of {self.info.max_context}",
            )
        elif min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            problem = LorafleetError(ErrorCode.INVALID_TOKEN_ID, f"token ids must be in [0, {self.info.vocab_size})")
        elif request.adapter is not None and self.adapter_pool is None:
            problem = LorafleetError(
                ErrorCode.ADAPTER_EXCEEDS_MODEL_LIMITS,
                f"adapter {request.adapter.name!r} cannot be served: this worker runs without LoRA (--max-loras 0)",
            )
        max_tokens = min(request.sampling.max_tokens, max(room, 0))
        if problem is None and -(-(len(prompt) + max_tokens) // self.blocks.block_size) > self.blocks.num_blocks:
            problem = LorafleetError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt plus max_tokens exceeds this worker's whole KV cache"
            )
        if problem is not None:
            now = time.time()
            error = JobError(problem.code, problem.message)
            return EngineResult(request.job_id, JobStatus.FAILED, error=error, added_at=now, finished_at=now)

        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
        seq = Sequence(
            seq_id=request.job_id,
            prompt_token_ids=prompt,
            sampling=request.sampling,
            seed=seed,
            tenant=request.tenant,
            adapter_uid=None if request.adapter is None else request.adapter.uid,
            priority=request.priority,
            arrival=time.monotonic(),
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling.stop)
        self._tracked[request.job_id] = _Tracked(request, seq, detokenizer, max_tokens, added_at=time.time())
        self.scheduler.add(seq)
        if request.adapter is not None:
            self.adapter_pool.request(request.adapter)  # prefetch: loads while earlier requests run
        return None

    def take_deltas(self) -> list[TokenDelta]:
        """The token deltas of unfinished requests since the last call (one per sampled token); text
        that could still become a stop string is held back, and a finished request's text is its
        result's, so a streamer completes the text from the result."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def abort(self, job_id: str) -> bool:
        """Drop a request (canceled); its blocks and adapter pin are freed at once."""
        tracked = self._tracked.pop(job_id, None)
        if tracked is None:
            return False
        self._release(tracked.seq)
        return True

    def step(self) -> list[EngineResult]:
        """Launch one batch step, then finish the step launched before it. Returns the requests that
        finished (or failed) meanwhile.

        The device runs step N while the host reads step N-1's tokens (detokenizing, stop checks,
        deltas, results): step N is scheduled as if every running sequence goes on, and its inputs
        take step N-1's tokens on the device (`_mark_launched`). A sequence that step N-1 ends with a
        stop token or string wastes its row of step N, which is discarded."""
        in_flight, self._in_flight = self._in_flight, None
        results = self._launch_step(after=in_flight)
        if in_flight is not None:
            results += self._finish_step(in_flight)
        return results

    def _launch_step(self, *, after: _InFlight | None) -> list[EngineResult]:
        """Schedule a step and launch it without waiting for it (into self._in_flight). Returns the
        requests that failed on the way. after: the earlier step still in flight (None: the engine was
        idle), whose tokens would be kept waiting if this one waited for adapter loads."""
        idle = after is None
        self.last_step = StepStats()
        results = self._expire_overdue()
        if self.adapter_pool is not None:
            results += self._fail_adapter_loads(self.adapter_pool.poll())
        admit = self._pacer is None or self._pacer.may_admit(running=bool(self.scheduler.running))
        plan = self.scheduler.schedule(admit=admit)
        if plan.num_admitted and self._pacer is not None:
            self._pacer.admitted()
        scheduled = [s for s in plan.scheduled if s.seq.seq_id in self._tracked]
        if not scheduled:
            if idle and self.adapter_pool is not None and self.adapter_pool.loads_in_flight:
                self.adapter_pool.wait(_IDLE_WAIT_S)  # only adapter loads can unblock the queue
            return results
        readers = {s.seq.adapter_uid for s in scheduled if s.seq.adapter_uid is not None}
        started = _device_mark(self.runner.device)
        try:
            scheduled, sampled = self._run_within_memory(scheduled)
        except torch.OutOfMemoryError:
            # halving keeps the front of the batch, so the one sequence that did not fit alone is the first
            log.warning("request_out_of_memory", job=scheduled[0].seq.seq_id)
            error = JobError(ErrorCode.OUT_OF_MEMORY, "the request does not fit in device memory even alone")
            return [*results, self._fail(scheduled[0].seq.seq_id, error)]
        except Exception as exc:  # a failed step fails its requests, not the worker
            log.exception("engine_step_failed", num_seqs=len(scheduled))
            error = JobError(ErrorCode.INTERNAL_ERROR, f"engine step failed: {type(exc).__name__}")
            return results + [self._fail(s.seq.seq_id, error) for s in scheduled]
        finally:  # whatever was launched, a step halved for memory or one that failed midway included
            if readers:
                self.adapter_pool.launched(readers)
        self.last_step = StepStats(
            len(scheduled),
            sum(s.num_new_tokens for s in scheduled),
            sum(s.completes_prompt for s in scheduled),
            len({s.seq.adapter_uid for s in scheduled if s.seq.adapter_uid is not None}),
        )
        follows = None if after is None else after.sampled.ready
        self._in_flight = self._mark_launched(scheduled, sampled, started, follows)
        return results

    def _run_within_memory(self, scheduled: list[ScheduledSequence]) -> tuple[list[ScheduledSequence], SampledTokens]:
        """Run the step's forward pass and sampling. When the device runs out of memory, hand the newer
        half of the batch back to the scheduler (preempted, recomputed in a later step) and retry with
        the rest; raises OutOfMemoryError only when a single sequence does not fit."""
        while True:
            try:
                logits = self.runner.execute(scheduled, self.adapter_slots.slot_of, self.blocks.block_size)
                return scheduled, self.runner.sample(logits, scheduled)
            except Exception as exc:
                if self.runner.channel is not None:  # the followers ran this step, or wait inside it
                    raise RanksOutOfStep(f"a step failed on rank 0: {type(exc).__name__}: {exc}") from exc
                if not isinstance(exc, torch.OutOfMemoryError) or len(scheduled) == 1:
                    raise
                keep = len(scheduled) // 2
                log.warning("step_out_of_memory", num_seqs=len(scheduled), retrying_with=keep)
                for item in scheduled[keep:]:
                    self.scheduler.preempt(item.seq)
                scheduled = scheduled[:keep]
                torch.cuda.empty_cache()  # a no-op unless CUDA is in use

    def _mark_launched(
        self,
        scheduled: list[ScheduledSequence],
        sampled: SampledTokens,
        started: torch.cuda.Event | None,
        follows: torch.cuda.Event | None,
    ) -> _InFlight:
        """Advance each sequence past a launched step as if its token were known: the cache holds its
        scheduled tokens, and a sequence that goes on gets the stand-in token -(row + 1), which the
        next step's inputs read from the device (ModelRunner.execute). A sequence whose length limit
        this token reaches gets none: with nothing left to compute the scheduler leaves it out until
        the token lands and finishes it."""
        output_index: list[int | None] = []
        for row, item in enumerate(scheduled):
            seq = item.seq
            completes = item.completes_prompt
            seq.num_computed_tokens += item.num_new_tokens
            if not completes:
                output_index.append(None)  # a prefill chunk: the next token comes from a later step
                continue
            index = len(seq.output_token_ids)
            if not self._reaches_length_limit(self._tracked[seq.seq_id], index + 1):
                seq.output_token_ids.append(-(row + 1))
            output_index.append(index)
        return _InFlight(scheduled, sampled, output_index, started, follows)

    def _finish_step(self, step: _InFlight) -> list[EngineResult]:
        """Read a launched step's tokens (waiting for its device work, not for later steps') and act on them."""
        tokens, finite = step.sampled.wait()
        if step.started is not None and step.follows is not None:  # both have happened: the step is done
            idle_s = step.follows.elapsed_time(step.started) / 1000
            self.last_step = dataclasses.replace(self.last_step, device_idle_s=max(idle_s, 0.0))
        results: list[EngineResult] = []
        for item, index, token, ok in zip(step.scheduled, step.output_index, tokens, finite, strict=True):
            tracked = self._tracked.get(item.seq.seq_id)
            if tracked is None or tracked.seq is not item.seq:
                continue  # ended (stopped, aborted, failed, expired) since the launch: its row is discarded
            if not ok:
                error = JobError(ErrorCode.NUMERICAL_ERROR, "the model produced non-finite logits")
                results.append(self._fail(item.seq.seq_id, error))
                continue
            result = None if index is None else self._advance(tracked, index, token)
            if result is not None:
                results.append(result)
        return results

    def _reaches_length_limit(self, tracked: _Tracked, num_output_tokens: int) -> bool:
        seq = tracked.seq
        return (
            num_output_tokens >= tracked.max_tokens
            or len(seq.prompt_token_ids) + num_output_tokens >= self.info.max_context
        )

    def _advance(self, tracked: _Tracked, index: int, token: int) -> EngineResult | None:
        """Put a step's sampled `token` at output position `index` (over its stand-in, if it has one)."""
        seq = tracked.seq
        if index < len(seq.output_token_ids):
            seq.output_token_ids[index] = token
        else:
            seq.output_token_ids.append(token)  # the last token, which no later step needed
        if not tracked.first_token_at:
            tracked.first_token_at = time.time()
        hit_stop_string = tracked.detokenizer.append(token)
        if hit_stop_string or (token in self.info.eos_token_ids and not seq.sampling.ignore_eos):
            return self._succeed(tracked, FinishReason.STOP)
        if self._reaches_length_limit(tracked, index + 1):
            return self._succeed(tracked, FinishReason.LENGTH)
        if tracked.request.stream:
            self._record_delta(tracked, token)
        return None

    def _record_delta(self, tracked: _Tracked, token: int) -> None:
        # the last (longest stop string - 1) characters may yet begin a stop string that gets cut
        holdback = max((len(s) for s in tracked.request.sampling.stop), default=1) - 1
        final_chars = max(tracked.streamed_chars, len(tracked.detokenizer.text) - holdback)
        text = tracked.detokenizer.text[tracked.streamed_chars : final_chars]
        self._deltas.append(TokenDelta(tracked.seq.seq_id, token, text, tracked.streamed_chars))
        tracked.streamed_chars = final_chars

    def _succeed(self, tracked: _Tracked, reason: FinishReason) -> EngineResult:
        seq = tracked.seq
        while seq.output_token_ids[-1] < 0:
            seq.output_token_ids.pop()  # the stand-in of a step launched after the one that finished it
        del self._tracked[seq.seq_id]
        self._release(seq)
        output = JobOutput(text=tracked.detokenizer.text, token_ids=tuple(seq.output_token_ids), finish_reason=reason)
        return EngineResult(
            seq.seq_id,
            JobStatus.SUCCEEDED,
            output=output,
            completion_tokens=len(seq.output_token_ids),
            added_at=tracked.added_at,
            first_token_at=tracked.first_token_at,
            finished_at=time.time(),
        )

    def _fail(self, job_id: str, error: JobError, status: JobStatus = JobStatus.FAILED) -> EngineResult:
        tracked = self._tracked.pop(job_id)
        self._release(tracked.seq)
        return EngineResult(
            job_id,
            status,
            error=error,
            completion_tokens=sum(token >= 0 for token in tracked.seq.output_token_ids),  # stand-ins are < 0
            added_at=tracked.added_at,
            first_token_at=tracked.first_token_at,
            finished_at=time.time(),
        )

    def _expire_overdue(self) -> list[EngineResult]:
        now = time.time()
        overdue = [t for t in self._tracked.values() if t.request.deadline is not None and t.request.deadline < now]
        error = JobError(ErrorCode.DEADLINE_EXCEEDED, "the job's deadline passed before it finished")
        return [self._fail(t.seq.seq_id, error, JobStatus.EXPIRED) for t in overdue]

    def _release(self, seq: Sequence) -> None:
        """A request left the engine: its blocks and adapter pin go back, and its adapter's demand."""
        self.scheduler.finish(seq)
        if seq.adapter_uid is not None:
            self.adapter_pool.drop(seq.adapter_uid)

    def _fail_adapter_loads(self, failures: list[LoadFailure]) -> list[EngineResult]:
        """Fail the requests of adapters whose load failed; every other request goes on."""
        results: list[EngineResult] = []
        for failure in failures:
            users = [t for t in self._tracked.values() if t.seq.adapter_uid == failure.uid]
            for tracked in users:
                message = f"adapter {tracked.request.adapter.name!r} could not be loaded: {failure.message}"
                results.append(self._fail(tracked.seq.seq_id, JobError(ErrorCode.ADAPTER_LOAD_FAILED, message)))
        return results


def _device_mark(device: torch.device) -> torch.cuda.Event | None:
    """A timed event recorded now on `device`'s current stream; None on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
