"""Continuous batching (torch-free): which sequences run in the next step, and how many tokens each.

Every step, in this order:
1. Running sequences, oldest first, each get their uncomputed tokens (one for a decode, a chunk of
   the prompt for a prefill still in progress) within the step's token budget. When the KV cache is
   full, the newest running sequences are preempted: their blocks are freed and they wait to be
   recomputed, so memory pressure never becomes an out-of-memory error.
2. Waiting sequences are admitted first-come first-served while the budget, the running-batch size
   and KV blocks allow. A sequence whose adapter is not resident on the device yet (the adapter pool
   is still loading it) is passed over, so it does not block base-model or resident-adapter work.
   A tenant already running `max_seqs_per_tenant` sequences is passed over too, but only while
   others wait: the cap keeps one tenant's burst from starving the rest without leaving the batch
   idle when that tenant is alone.
Long prompts are prefilled in chunks that share each step with running decodes.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from worker.adapter_pool.gpu_slots import GpuSlots
from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is cached, so the step's logits give a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_admitted: int = 0  # sequences that started running in this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        adapter_slots: GpuSlots,
        max_seqs_per_tenant: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seqs_per_tenant = max_seqs_per_tenant or max_num_seqs
        self.blocks = block_manager
        self.adapters = adapter_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start; a steady rise means the KV cache is too small

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, *, admit: bool = True) -> SchedulerOutput:
        """The next step's work; `admit=False` runs only the running sequences (the engine paces
        admissions when they cost an eager step: admission_pacer.py)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:  # its last token is still on its way from the device (engine.py): nothing to run
                index += 1
                continue
            if not self._make_room(seq, seq.num_computed_tokens + num_new, out):
                break  # seq itself was preempted: nothing newer is left to run
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            index += 1

        running_per_tenant = Counter(seq.tenant for seq in self.running)
        passed_over: list[Sequence] = []
        over_cap: list[Sequence] = []
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if running_per_tenant[seq.tenant] >= self.max_seqs_per_tenant:
                over_cap.append(seq)
                continue
            admitted = self._admit(seq, budget, out)
            if admitted is None:
                passed_over.append(seq)
            elif admitted == 0:
                self.waiting.appendleft(seq)
                break
            else:
                running_per_tenant[seq.tenant] += 1
                budget -= admitted
        # nobody else could use the room: capped tenants may fill it (the cap never idles the batch)
        while admit and over_cap and not self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = over_cap.pop(0)
            admitted = self._admit(seq, budget, out)
            if admitted is None:
                passed_over.append(seq)
            elif admitted == 0:
                over_cap.insert(0, seq)
                break
            else:
                budget -= admitted
        self.waiting.extendleft(reversed(passed_over + over_cap))
        return out

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Try to start `seq` within `budget` tokens. Returns the tokens scheduled; 0 when the KV
        cache is full (stop admitting); None when its adapter is not resident yet (pass it over)."""
        if seq.adapter_uid is not None and self.adapters.acquire(seq.adapter_uid) is None:
            return None
        num_new = min(seq.num_uncomputed_tokens, budget)
        if not self.blocks.can_allocate(self.blocks.blocks_needed(seq, seq.num_computed_tokens + num_new)):
            if seq.adapter_uid is not None:
                self.adapters.release(seq.adapter_uid)
            return 0
        self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSequence(seq, num_new))
        out.num_admitted += 1
        return num_new

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can hold `num_tokens` tokens.
        Returns False if `seq` had to be preempted itself."""
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, num_tokens)):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and adapter pin; it waits at the front to be recomputed."""
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        if seq.adapter_uid is not None:
            self.adapters.release(seq.adapter_uid)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence, returning its blocks and adapter pin."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
            if seq.adapter_uid is not None:
                self.adapters.release(seq.adapter_uid)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
