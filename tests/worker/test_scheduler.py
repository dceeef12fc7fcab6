"""The continuous-batching scheduler and block manager: torch-free behaviour."""

from __future__ import annotations

import pytest

from shared.schema import Priority, SamplingParams
from worker.adapter_pool.eviction import LRUPolicy
from worker.adapter_pool.gpu_slots import GpuSlots
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

_arrivals = iter(range(1_000_000))


def make_seq(
    prompt_len: int,
    adapter: str | None = None,
    name: str | None = None,
    tenant: str = "t",
    priority: Priority = Priority.INTERACTIVE,
) -> Sequence:
    arrival = next(_arrivals)
    return Sequence(
        seq_id=name or f"s{arrival}",
        tenant=tenant,
        prompt_token_ids=list(range(prompt_len)),
        sampling=SamplingParams(max_tokens=100),
        seed=0,
        adapter_uid=adapter,
        priority=priority,
        arrival=float(arrival),
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_seqs: int = 8,
    budget: int = 64,
    slots: int = 2,
    per_tenant: int | None = None,
    overtakes: int = 4,
) -> Scheduler:
    return Scheduler(
        max_num_seqs=max_seqs,
        max_seqs_per_tenant=per_tenant,
        max_overtakes=overtakes,
        max_num_batched_tokens=budget,
        block_manager=BlockManager(num_blocks, block_size),
        adapter_slots=GpuSlots(slots, LRUPolicy()),
    )


def make_resident(scheduler: Scheduler, uid: str) -> None:
    """What the adapter pool does once an adapter's weights have landed in a slot."""
    assert scheduler.adapters.reserve(uid, 1, evictable=lambda _: True) is not None
    scheduler.adapters.mark_ready(uid)


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule one step and pretend the model ran it: computed tokens advance, completed
    prompts get one new output token. Returns {seq_id: tokens scheduled}."""
    plan = scheduler.schedule()
    for item in plan.scheduled:
        completes = item.completes_prompt
        item.seq.num_computed_tokens += item.num_new_tokens
        if completes:
            item.seq.output_token_ids.append(7)
    return {item.seq.seq_id: item.num_new_tokens for item in plan.scheduled}


def test_new_requests_join_a_running_batch_on_the_next_step():
    scheduler = make_scheduler()
    first = make_seq(5, name="first")
    scheduler.add(first)
    assert run_step(scheduler) == {"first": 5}
    scheduler.add(make_seq(3, name="second"))
    assert run_step(scheduler) == {"first": 1, "second": 3}
    assert run_step(scheduler) == {"first": 1, "second": 1}


def test_finished_sequences_leave_and_return_their_blocks():
    scheduler = make_scheduler(num_blocks=8)
    seq = make_seq(6)
    scheduler.add(seq)
    run_step(scheduler)
    assert scheduler.blocks.num_free_blocks == 6
    scheduler.finish(seq)
    assert scheduler.blocks.num_free_blocks == 8
    assert seq.status is SequenceStatus.FINISHED
    assert not scheduler.has_unfinished


def test_long_prompt_is_prefilled_in_chunks_beside_running_decodes():
    scheduler = make_scheduler(budget=8)
    short = make_seq(2, name="short")
    scheduler.add(short)
    run_step(scheduler)
    scheduler.add(make_seq(20, name="long"))
    steps = [run_step(scheduler) for _ in range(4)]
    assert steps == [
        {"short": 1, "long": 7},
        {"short": 1, "long": 7},
        {"short": 1, "long": 6},  # the last chunk completes the prompt...
        {"short": 1, "long": 1},  # ...and the long sequence decodes from then on
    ]


def test_step_never_exceeds_the_token_budget():
    scheduler = make_scheduler(budget=10)
    for _ in range(5):
        scheduler.add(make_seq(7))
    for _ in range(10):
        assert sum(run_step(scheduler).values()) <= 10


def test_running_batch_is_capped_at_max_num_seqs():
    scheduler = make_scheduler(max_seqs=2)
    for _ in range(4):
        scheduler.add(make_seq(1))
    assert len(run_step(scheduler)) == 2
    assert len(scheduler.waiting) == 2


def test_admission_waits_for_free_kv_blocks():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    scheduler.add(make_seq(8, name="big"))
    scheduler.add(make_seq(8, name="next"))
    assert run_step(scheduler) == {"big": 8}
    assert [s.seq_id for s in scheduler.waiting] == ["next"]


def test_full_cache_preempts_the_newest_sequence_instead_of_failing():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    old, new = make_seq(8, name="old"), make_seq(8, name="new")
    scheduler.add(old)
    scheduler.add(new)
    assert run_step(scheduler) == {"old": 8, "new": 8}  # 4 blocks used, both at 9 tokens next
    plan = scheduler.schedule()
    assert [s.seq_id for s in plan.preempted] == ["new"]
    assert [item.seq.seq_id for item in plan.scheduled] == ["old"]
    assert new.status is SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new


def test_preempted_sequence_is_recomputed_with_its_output_so_far():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    old, new = make_seq(8, name="old"), make_seq(7, name="new")
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    run_step(scheduler)  # preempts new (which has one output token)
    scheduler.finish(old)
    assert run_step(scheduler) == {"new": 8}  # 7 prompt tokens + its 1 output token


def test_sequence_whose_adapter_is_not_resident_waits_without_blocking_others():
    scheduler = make_scheduler(slots=2)
    make_resident(scheduler, "a")
    scheduler.add(make_seq(2, adapter="b", name="b"))  # still loading
    scheduler.add(make_seq(2, adapter="a", name="a"))
    scheduler.add(make_seq(2, name="base"))
    assert run_step(scheduler) == {"a": 2, "base": 2}
    assert [s.seq_id for s in scheduler.waiting] == ["b"]
    make_resident(scheduler, "b")
    assert run_step(scheduler) == {"a": 1, "base": 1, "b": 2}


def test_a_sequence_waiting_on_its_adapter_leaves_the_only_batch_slot_and_the_kv_to_another():
    scheduler = make_scheduler(max_seqs=1)
    waiting = make_seq(2, adapter="b", name="b")  # first in line, its adapter still on disk
    scheduler.add(waiting)
    scheduler.add(base := make_seq(2, name="base"))
    assert run_step(scheduler) == {"base": 2}
    assert [s.seq_id for s in scheduler.running] == ["base"] and [s.seq_id for s in scheduler.waiting] == ["b"]
    assert waiting.block_table == [] and scheduler.blocks.num_blocks - scheduler.blocks.num_free_blocks == len(
        base.block_table
    )


def test_running_sequences_pin_their_adapter_until_they_finish():
    scheduler = make_scheduler(slots=1)
    make_resident(scheduler, "a")
    first, second = make_seq(2, adapter="a"), make_seq(2, adapter="a")
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    scheduler.finish(first)
    assert scheduler.adapters.reserve("b", 1, evictable=lambda _: True) is None  # second still pins it
    scheduler.finish(second)
    assert scheduler.adapters.reserve("b", 1, evictable=lambda _: True).evicted_uids == ("a",)


def test_a_sequence_refused_for_kv_room_gives_its_adapter_pin_back():
    scheduler = make_scheduler(num_blocks=2, block_size=4, slots=1)
    make_resident(scheduler, "a")
    scheduler.add(make_seq(8, name="big"))
    scheduler.add(make_seq(4, adapter="a", name="late"))
    assert run_step(scheduler) == {"big": 8}
    assert scheduler.adapters.reserve("b", 1, evictable=lambda _: True).evicted_uids == ("a",)


def test_block_manager_slots_follow_the_block_table():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(6)
    manager.allocate(seq, 6)
    assert len(seq.block_table) == 2
    assert manager.slot(seq, 5) == seq.block_table[1] * 4 + 1
    with pytest.raises(RuntimeError):
        manager.allocate(make_seq(40), 40)


def test_one_tenants_burst_cannot_take_the_whole_batch_while_others_wait():
    scheduler = make_scheduler(max_seqs=4, per_tenant=2)
    for i in range(6):
        scheduler.add(make_seq(2, tenant="noisy", name=f"noisy{i}"))
    scheduler.add(make_seq(2, tenant="quiet", name="quiet"))
    running = run_step(scheduler)
    assert "quiet" in running
    assert sum(name.startswith("noisy") for name in running) == 3  # 2 by the cap, +1 once quiet is in


def test_tenant_cap_never_leaves_the_batch_idle_when_the_tenant_is_alone():
    scheduler = make_scheduler(max_seqs=4, per_tenant=1)
    for _ in range(4):
        scheduler.add(make_seq(2, tenant="only"))
    assert len(run_step(scheduler)) == 4


def test_capped_sequences_keep_their_place_in_the_queue():
    scheduler = make_scheduler(max_seqs=2, per_tenant=1)
    scheduler.add(make_seq(2, tenant="a", name="a1"))
    scheduler.add(make_seq(2, tenant="a", name="a2"))
    scheduler.add(make_seq(2, tenant="b", name="b1"))
    scheduler.add(make_seq(2, tenant="b", name="b2"))
    assert set(run_step(scheduler)) == {"a1", "b1"}
    assert [s.seq_id for s in scheduler.waiting] == ["a2", "b2"]


def test_without_admission_only_running_sequences_advance_and_the_waiting_keep_their_order() -> None:
    scheduler = make_scheduler()
    first = make_seq(4, name="first")
    scheduler.add(first)
    assert scheduler.schedule().num_admitted == 1
    first.num_computed_tokens = 4
    first.output_token_ids.append(7)
    later = [make_seq(4, name=f"later{i}") for i in range(3)]
    for seq in later:
        scheduler.add(seq)
    held = scheduler.schedule(admit=False)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in held.scheduled] == [("first", 1)]
    assert held.num_admitted == 0 and list(scheduler.waiting) == later
    assert scheduler.schedule().num_admitted == 3


def batch_seq(prompt_len: int, name: str, tenant: str = "t") -> Sequence:
    return make_seq(prompt_len, name=name, tenant=tenant, priority=Priority.BATCH)


def test_interactive_requests_are_admitted_before_batch_requests_that_arrived_earlier():
    scheduler = make_scheduler(max_seqs=2)
    scheduler.add(batch_seq(3, "batch"))
    scheduler.add(make_seq(3, name="chat"))
    scheduler.add(make_seq(3, name="chat2"))
    assert run_step(scheduler) == {"chat": 3, "chat2": 3}
    assert [s.seq_id for s in scheduler.waiting] == ["batch"]


def test_batch_requests_fill_what_is_left_of_the_step():
    scheduler = make_scheduler(budget=10)
    scheduler.add(batch_seq(8, "batch"))
    scheduler.add(make_seq(6, name="chat"))
    assert run_step(scheduler) == {"chat": 6, "batch": 4}  # the batch prompt's first chunk in the rest
    assert run_step(scheduler) == {"chat": 1, "batch": 4}


def test_interactive_request_preempts_a_running_batch_request_for_kv_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    batch = batch_seq(12, "batch")
    scheduler.add(batch)
    assert run_step(scheduler) == {"batch": 12}  # 3 of the 4 blocks
    scheduler.add(make_seq(8, name="chat"))
    plan = scheduler.schedule()
    assert [item.seq.seq_id for item in plan.scheduled] == ["chat"]
    assert plan.preempted == [batch] and batch.num_computed_tokens == 0  # its blocks freed, recomputed later
    assert scheduler.waiting == [batch] and scheduler.num_preemptions == 1


def test_interactive_request_preempts_a_running_batch_request_for_a_running_slot():
    scheduler = make_scheduler(max_seqs=2)
    older, newer = batch_seq(3, "older"), batch_seq(3, "newer")
    scheduler.add(older)
    scheduler.add(newer)
    run_step(scheduler)
    scheduler.add(make_seq(3, name="chat"))
    assert run_step(scheduler) == {"chat": 3, "older": 1}  # the newest batch request made room
    assert scheduler.waiting == [newer]


def test_batch_requests_never_preempt_interactive_ones():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_seqs=2)
    scheduler.add(make_seq(12, name="chat"))
    run_step(scheduler)
    scheduler.add(batch_seq(8, "batch"))
    assert run_step(scheduler) == {"chat": 1}
    assert [s.seq_id for s in scheduler.waiting] == ["batch"] and scheduler.num_preemptions == 0


def test_a_full_cache_preempts_an_older_batch_request_before_a_newer_interactive_one():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    batch = batch_seq(4, "batch")
    scheduler.add(batch)
    run_step(scheduler)
    chat = make_seq(4, name="chat")
    scheduler.add(chat)
    assert run_step(scheduler) == {"chat": 4, "batch": 1}  # all 3 blocks taken
    plan = scheduler.schedule()  # chat's fifth token needs a block
    assert [item.seq.seq_id for item in plan.scheduled] == ["chat"] and plan.preempted == [batch]


def test_tenant_fairness_holds_within_the_batch_class():
    scheduler = make_scheduler(max_seqs=2, per_tenant=1)
    for i in range(2):
        scheduler.add(batch_seq(2, f"a{i}", tenant="a"))
    scheduler.add(batch_seq(2, "b0", tenant="b"))
    assert set(run_step(scheduler)) == {"a0", "b0"}


def admitted(scheduler: Scheduler) -> list[str]:
    """The sequences one step admits, in admission order."""
    plan = scheduler.schedule()
    return [item.seq.seq_id for item in plan.scheduled if item.seq.num_computed_tokens == 0]


def running_on(scheduler: Scheduler, *seqs: Sequence) -> None:
    """`seqs` admitted and past their prefill."""
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        seq.output_token_ids.append(7)


def test_a_request_whose_adapter_runs_goes_before_older_ones_whose_adapter_does_not():
    scheduler = make_scheduler(max_seqs=2, slots=3)
    for uid in ("a", "b"):
        make_resident(scheduler, uid)
    running_on(scheduler, make_seq(2, adapter="a"))
    scheduler.add(make_seq(2, adapter="b", name="older"))
    scheduler.add(make_seq(2, adapter="a", name="newer"))
    assert admitted(scheduler) == ["newer"]
    assert [s.seq_id for s in scheduler.waiting] == ["older"] and scheduler.waiting[0].overtaken == 1


def test_base_model_requests_read_no_new_adapter_and_go_before_those_that_would():
    scheduler = make_scheduler(max_seqs=2, slots=3)
    for uid in ("a", "b"):
        make_resident(scheduler, uid)
    running_on(scheduler, make_seq(2, adapter="a"))
    scheduler.add(make_seq(2, adapter="b", name="adapter"))
    scheduler.add(make_seq(2, name="base"))
    assert admitted(scheduler) == ["base"]


def test_admission_is_first_come_first_served_when_grouping_gains_nothing():
    scheduler = make_scheduler(max_seqs=3, slots=3)
    for uid in ("a", "b", "c"):
        make_resident(scheduler, uid)
    running_on(scheduler, make_seq(2, adapter="a"))
    for uid in ("b", "c"):  # neither adapter runs
        scheduler.add(make_seq(2, adapter=uid, name=uid))
    scheduler.add(make_seq(2, adapter="c", name="c2"))
    assert admitted(scheduler) == ["b", "c"]  # c2 would group with c, but the oldest came first
    assert [(s.seq_id, s.overtaken) for s in scheduler.waiting] == [("c2", 0)]


def test_an_adapter_admitted_in_a_step_groups_the_rest_of_that_step():
    scheduler = make_scheduler(max_seqs=2, slots=3)
    for uid in ("b", "c"):
        make_resident(scheduler, uid)
    for name, uid in (("b1", "b"), ("c1", "c"), ("b2", "b")):
        scheduler.add(make_seq(2, adapter=uid, name=name))
    assert admitted(scheduler) == ["b1", "b2"]
    assert [s.seq_id for s in scheduler.waiting] == ["c1"]


def admission_order(overtakes: int) -> list[str]:
    """A request for a rare adapter waits behind one running a popular adapter, while that adapter's
    requests keep arriving; one running slot frees a step."""
    scheduler = make_scheduler(max_seqs=2, slots=2, overtakes=overtakes)
    for uid in ("popular", "rare"):
        make_resident(scheduler, uid)
    running_on(scheduler, make_seq(2, adapter="popular"))
    scheduler.add(make_seq(2, adapter="rare", name="rare"))
    order = []
    for step in range(4):
        scheduler.add(make_seq(2, adapter="popular", name=f"popular{step}"))
        order += admitted(scheduler)
        scheduler.finish(next(seq for seq in scheduler.running if seq.seq_id == order[-1]))
    return order


def test_a_request_overtaken_max_overtakes_times_is_admitted_before_any_grouped_one():
    assert admission_order(overtakes=2) == ["popular0", "popular1", "rare", "popular2"]


def test_grouping_off_is_first_come_first_served():
    assert admission_order(overtakes=0) == ["rare", "popular0", "popular1", "popular2"]


def test_grouping_never_puts_a_batch_request_before_an_interactive_one():
    scheduler = make_scheduler(max_seqs=2, slots=2)
    for uid in ("a", "b"):
        make_resident(scheduler, uid)
    running_on(scheduler, make_seq(2, adapter="a", priority=Priority.BATCH))
    scheduler.add(make_seq(2, adapter="b", name="chat"))
    scheduler.add(make_seq(2, adapter="a", name="batch", priority=Priority.BATCH))
    assert admitted(scheduler) == ["chat"]
    assert [s.seq_id for s in scheduler.waiting] == ["batch"]


def test_grouping_keeps_the_tenant_cap():
    scheduler = make_scheduler(max_seqs=2, slots=2, per_tenant=1)
    for uid in ("a", "b"):
        make_resident(scheduler, uid)
    running_on(scheduler, make_seq(2, adapter="a", tenant="x"))
    scheduler.add(make_seq(2, adapter="b", tenant="y", name="other tenant"))
    scheduler.add(make_seq(2, adapter="a", tenant="x", name="same adapter, capped tenant"))
    assert admitted(scheduler) == ["other tenant"]


def test_a_due_request_whose_adapter_is_still_loading_does_not_hold_up_the_others():
    scheduler = make_scheduler(max_seqs=2, slots=2, overtakes=1)
    make_resident(scheduler, "a")
    running_on(scheduler, make_seq(2, adapter="a"))
    loading = make_seq(2, adapter="b", name="loading")
    loading.overtaken = 1  # due, but its adapter is not on the device yet
    scheduler.add(loading)
    scheduler.add(make_seq(2, adapter="a", name="grouped"))
    assert admitted(scheduler) == ["grouped"]
    assert loading.block_table == [] and scheduler.waiting == [loading]


def test_a_request_becomes_due_within_the_step_that_overtakes_it_to_the_bound():
    def one_step(overtakes: int) -> tuple[list[str], int]:
        scheduler = make_scheduler(max_seqs=3, slots=2, overtakes=overtakes)
        for uid in ("a", "b"):
            make_resident(scheduler, uid)
        running_on(scheduler, make_seq(2, adapter="a"))
        older = make_seq(2, adapter="b", name="older")
        for seq in (older, make_seq(2, adapter="a", name="a1"), make_seq(2, adapter="a", name="a2")):
            scheduler.add(seq)
        return admitted(scheduler), older.overtaken

    assert one_step(overtakes=4) == (["a1", "a2"], 2)
    assert one_step(overtakes=1) == (["a1", "older"], 1)
