"""Continuous batching (torch-free): which sequences run in the next step, and how many tokens each.

Every step serves the interactive class first, then the batch class (shared/schema.py Priority):
batch work fills what is left of the step's token budget, running slots and KV blocks. For each
class, in this order:
1. Running sequences, oldest first, each get their uncomputed tokens (one for a decode, a chunk of
   the prompt for a prefill still in progress) within the step's token budget. When the KV cache is
   full, running sequences are preempted, the newest batch sequence first, then the newest of the
   sequence's own class (batch work never preempts interactive work): their blocks are freed and they
   wait to be recomputed, so memory pressure never becomes an out-of-memory error.
2. Waiting sequences are admitted while the budget, the running-batch size and KV blocks allow;
   an interactive sequence that finds no running slot or no KV room preempts the newest running
   batch sequence instead of waiting for it to finish. A sequence whose adapter is not resident on
   the device yet (the adapter pool is still loading it) is passed over, so it does not block
   base-model or resident-adapter work. A tenant already running `max_seqs_per_tenant` sequences of
   a class is passed over too, but only while others of that class wait: the cap keeps one tenant's
   burst from starving the rest of its class without leaving the batch idle when that tenant is alone.
Long prompts are prefilled in chunks that share each step with running decodes.

Admission order within a class is first-come first-served, with one exception, adapter grouping:
a sequence whose adapter the step reads already (a running sequence's, or one admitted earlier in
the same step; the base model always) goes before older ones whose adapter it does not read. The
LoRA kernels' cost grows with the distinct adapters a step reads (docs/benchmarks.md, "Multi-LoRA
kernels"), so a queue of Zipf traffic then adds fewer of them. It matters only when more wait than
the step admits. The unfairness is bounded: a sequence overtaken this way by `max_overtakes` later
arrivals of its class is due, and due sequences go first, oldest first, before any grouped one; so
a request never waits for more than `max_overtakes` admissions beyond its first-come first-served
turn because of grouping. `max_overtakes` 0: strict first-come first-served.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from shared.schema import PRIORITIES, Priority
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
        max_overtakes: int = 0,
    ) -> None:
        if max_overtakes < 0:
            raise ValueError("max_overtakes must be >= 0")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seqs_per_tenant = max_seqs_per_tenant or max_num_seqs
        self.max_overtakes = max_overtakes
        self.blocks = block_manager
        self.adapters = adapter_slots
        self._waiting: dict[Priority, deque[Sequence]] = {priority: deque() for priority in PRIORITIES}
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start; a steady rise means the KV cache is too small

    def add(self, seq: Sequence) -> None:
        self._waiting[seq.priority].append(seq)

    @property
    def waiting(self) -> list[Sequence]:
        """Every waiting sequence in the order they would be admitted: interactive, then batch."""
        return [seq for priority in PRIORITIES for seq in self._waiting[priority]]

    def waiting_of(self, priority: Priority) -> int:
        return len(self._waiting[priority])

    def running_of(self, priority: Priority) -> int:
        return sum(1 for seq in self.running if seq.priority is priority)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or any(self._waiting.values())

    def schedule(self, *, admit: bool = True) -> SchedulerOutput:
        """The next step's work; `admit=False` runs only the running sequences (the engine paces
        admissions when they cost an eager step: admission_pacer.py)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for priority in PRIORITIES:  # interactive first: batch work fills what is left of the step
            budget = self._run(priority, budget, out)
            if admit:
                budget = self._admit_waiting(priority, budget, out)
        return out

    def _run(self, priority: Priority, budget: int, out: SchedulerOutput) -> int:
        """Schedule the running sequences of `priority`, oldest first; returns the budget left."""
        for seq in [seq for seq in self.running if seq.priority is priority]:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an older sequence's room in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:  # its last token is still on its way from the device (engine.py): nothing to run
                continue
            if not self._make_room(seq, seq.num_computed_tokens + num_new, out):
                break  # seq itself was preempted: nothing newer of its class is left to run
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return budget

    def _admit_waiting(self, priority: Priority, budget: int, out: SchedulerOutput) -> int:
        """Admit waiting sequences of `priority` in admission order (`_admission_order`); returns the
        budget left. Those not admitted keep their first-come first-served places."""
        queue = self._waiting[priority]
        running_per_tenant = Counter(seq.tenant for seq in self.running if seq.priority is priority)
        read = {seq.adapter_uid for seq in self.running} | {None}  # adapters the step reads already
        tried: set[int] = set()
        # the order changes only when a sequence is admitted: passing one over costs no new order, so a
        # queue of sequences waiting on their adapters costs one pass, not one per sequence
        order = self._admission_order(queue, read, tried)
        over_cap: list[Sequence] = []
        while order and budget > 0 and self._has_slot(priority, out):
            seq = order.popleft()
            tried.add(id(seq))
            if running_per_tenant[seq.tenant] >= self.max_seqs_per_tenant:
                over_cap.append(seq)
                continue
            admitted = self._admit(seq, budget, out)
            if admitted == 0:  # the KV cache is full
                break
            if admitted is None:
                continue
            running_per_tenant[seq.tenant] += 1
            budget -= admitted
            if self.max_overtakes:  # grouping: seq may have overtaken older ones, and groups its adapter's
                read.add(seq.adapter_uid)
                order = self._admission_order(queue, read, tried, admitted=seq)
        # nobody else could use the room: capped tenants may fill it (the cap never idles the batch)
        while over_cap and not order and budget > 0 and self._has_slot(priority, out):
            admitted = self._admit(over_cap.pop(0), budget, out)
            if admitted == 0:
                break
            if admitted is not None:
                budget -= admitted
        still_waiting = [seq for seq in queue if seq.status is SequenceStatus.WAITING]
        queue.clear()
        queue.extend(still_waiting)
        return budget

    def _admission_order(
        self, queue: deque[Sequence], read: set[str | None], tried: set[int], admitted: Sequence | None = None
    ) -> deque[Sequence]:
        """The sequences of `queue` (oldest first) not `tried` yet (ids), in the order to try them: the due
        ones, then those whose adapter the step reads already (`read`), then the rest, each oldest first
        (module docstring). Those older than `admitted`, just admitted ahead of them, count an overtake."""
        if self.max_overtakes == 0:
            return deque(seq for seq in queue if id(seq) not in tried)
        due: list[Sequence] = []
        grouped: list[Sequence] = []
        rest: list[Sequence] = []
        overtaken = admitted is not None
        for seq in queue:
            if seq is admitted:
                overtaken = False
            elif id(seq) not in tried:
                if overtaken:
                    seq.overtaken += 1
                if seq.overtaken >= self.max_overtakes:
                    due.append(seq)
                else:
                    (grouped if seq.adapter_uid in read else rest).append(seq)
        return deque(due + grouped + rest)

    def _has_slot(self, priority: Priority, out: SchedulerOutput) -> bool:
        """Whether the running batch has room for one more `priority` sequence, an interactive one
        making it by preempting a batch sequence."""
        if len(self.running) < self.max_num_seqs:
            return True
        victim = self._batch_victim() if priority is Priority.INTERACTIVE else None
        if victim is None:
            return False
        self._preempt_for_room(victim, out)
        return True

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Try to start `seq` within `budget` tokens. Returns the tokens scheduled; 0 when the KV
        cache is full (stop admitting); None when its adapter is not resident yet (pass it over).
        An interactive sequence takes the KV blocks of running batch sequences when it must."""
        if seq.adapter_uid is not None and self.adapters.acquire(seq.adapter_uid) is None:
            return None
        num_new = min(seq.num_uncomputed_tokens, budget)
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, seq.num_computed_tokens + num_new)):
            victim = self._batch_victim() if seq.priority is Priority.INTERACTIVE else None
            if victim is None:
                if seq.adapter_uid is not None:
                    self.adapters.release(seq.adapter_uid)
                return 0
            self._preempt_for_room(victim, out)
        self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSequence(seq, num_new))
        out.num_admitted += 1
        return num_new

    def _batch_victim(self) -> Sequence | None:
        """The newest running batch sequence (the one that has done the least work), None if none runs."""
        return next((seq for seq in reversed(self.running) if seq.priority is Priority.BATCH), None)

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt running sequences, the newest batch one first, then the newest of `seq`'s class,
        until `seq` can hold `num_tokens` tokens. Returns False if `seq` had to be preempted itself."""
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, num_tokens)):
            victim = self._batch_victim() or self.running[-1]
            self._preempt_for_room(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt_for_room(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Preempt `victim` within a step: taken out of the step's work if it was scheduled in it."""
        self.preempt(victim)
        out.preempted.append(victim)
        out.scheduled = [item for item in out.scheduled if item.seq is not victim]

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and adapter pin; it waits at the front of its class to be recomputed."""
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        if seq.adapter_uid is not None:
            self.adapters.release(seq.adapter_uid)
        seq.status = SequenceStatus.WAITING
        self._waiting[seq.priority].appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence, returning its blocks and adapter pin."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
            if seq.adapter_uid is not None:
                self.adapters.release(seq.adapter_uid)
        elif seq in self._waiting[seq.priority]:
            self._waiting[seq.priority].remove(seq)
        seq.status = SequenceStatus.FINISHED
