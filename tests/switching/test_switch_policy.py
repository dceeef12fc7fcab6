"""The switching policy's cost model, decision by decision."""

from __future__ import annotations

from worker.switching.switch_policy import (
    MIN_RESIDENCY_FACTOR,
    CandidateModel,
    QueueState,
    ResidentModel,
    choose_switch,
)

IDLE = QueueState(0, 0.0)


def resident(
    model: str = "a", *, in_flight: int = 0, running_s: float = 0.0, queue: QueueState = IDLE, since_s: float = 100
) -> ResidentModel:
    return ResidentModel(model, queue, in_flight, running_s, since_s)


def candidate(model: str = "b", waiting: int = 1, oldest_s: float = 0.1, cost_s: float = 1.0) -> CandidateModel:
    return CandidateModel(model, QueueState(waiting, oldest_s), cost_s)


def test_no_waiting_jobs_elsewhere_means_no_switch() -> None:
    assert choose_switch([resident(in_flight=0)], [candidate(waiting=0)], free_slots=0) is None


def test_an_idle_resident_model_is_switched_out_for_the_first_waiting_job() -> None:
    decision = choose_switch([resident()], [candidate(waiting=1, oldest_s=0.01)], free_slots=0)
    assert decision is not None and (decision.incoming, decision.outgoing) == ("b", "a")


def test_a_free_slot_loads_without_evicting() -> None:
    decision = choose_switch([resident(in_flight=5)], [candidate()], free_slots=1)
    assert decision is not None and decision.outgoing is None


def test_a_busy_model_stays_until_the_waiting_pressure_outweighs_the_switch_cost() -> None:
    busy = resident(in_flight=4)  # cost = 1 s × 4 jobs = 4 job-s
    assert choose_switch([busy], [candidate(waiting=2, oldest_s=1.9)], free_slots=0) is None  # 3.8 job-s
    decision = choose_switch([busy], [candidate(waiting=2, oldest_s=2.1)], free_slots=0)  # 4.2 job-s
    assert decision is not None and decision.outgoing == "a"


def test_the_resident_models_own_queue_counts_against_switching_it_out() -> None:
    backlog = resident(in_flight=1, queue=QueueState(3, 2.0))  # cost = 1 s × 4 + 6 job-s
    assert choose_switch([backlog], [candidate(waiting=3, oldest_s=3.0)], free_slots=0) is None  # 9 job-s
    assert choose_switch([backlog], [candidate(waiting=3, oldest_s=3.5)], free_slots=0) is not None  # 10.5


def test_a_model_just_made_resident_is_not_switched_out_before_its_minimum_residency() -> None:
    fresh = resident(since_s=MIN_RESIDENCY_FACTOR * 1.0 - 0.1)
    assert choose_switch([fresh], [candidate(waiting=50, oldest_s=60.0)], free_slots=0) is None


def test_the_candidate_with_most_pressure_comes_in_and_the_least_loaded_resident_goes() -> None:
    residents = [resident("a", in_flight=3), resident("c", in_flight=0)]
    candidates = [candidate("b", waiting=1, oldest_s=5.0), candidate("d", waiting=4, oldest_s=2.0)]
    decision = choose_switch(residents, candidates, free_slots=0)
    assert decision is not None and (decision.incoming, decision.outgoing) == ("d", "c")


def test_work_already_done_by_running_jobs_counts_against_preempting_them() -> None:
    long_jobs = resident(in_flight=4, running_s=8.0)  # cost = 1 s × 4 + 8 job-s run so far
    assert choose_switch([long_jobs], [candidate(waiting=1, oldest_s=11.0)], free_slots=0) is None
    assert choose_switch([long_jobs], [candidate(waiting=1, oldest_s=12.5)], free_slots=0) is not None
