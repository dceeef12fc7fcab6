"""Adapter-aware placement (gateway/routing.py): the rules, one per test, and what a worker joining or
leaving moves; and the fleet view read from real heartbeat records."""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter

from gateway.routing import BALANCE, HOME_SLACK, FleetView, Placement, WorkerView, place, rendezvous_rank
from shared import keys

MODEL = "m"


def worker(
    worker_id: str, *, gpu: tuple[str, ...] = (), host: tuple[str, ...] = (), room: int = 8, capacity: int = 16
) -> WorkerView:
    return WorkerView(worker_id, frozenset(gpu), frozenset(host), room, capacity)


def home_of(adapter: str, worker_ids: list[str]) -> str:
    return max(worker_ids, key=lambda w: rendezvous_rank(adapter, w))


def rendezvous_order(adapter: str, worker_ids: list[str]) -> list[str]:
    return sorted(worker_ids, key=lambda w: rendezvous_rank(adapter, w), reverse=True)


def test_a_base_model_job_goes_to_the_shared_stream():
    route = place(MODEL, None, [worker("a", gpu=("x",))], {})
    assert route.queue is None and route.placement is Placement.SHARED


def test_with_no_live_worker_known_an_adapter_job_goes_to_the_shared_stream():
    assert place(MODEL, "x", [], {}).placement is Placement.SHARED


def test_a_worker_holding_the_adapter_on_its_gpu_is_preferred_over_host_and_home():
    workers = [worker("a", host=("x",)), worker("b", gpu=("x",)), worker("c")]
    route = place(MODEL, "x", workers, {})
    assert (route.placement, route.worker, route.queue) == (Placement.GPU, "b", keys.worker_queue(MODEL, "b"))


def test_a_host_tier_holder_is_preferred_over_the_home():
    workers = [worker("a"), worker("b", host=("x",)), worker("c")]
    assert place(MODEL, "x", workers, {}).worker == "b"


def test_among_gpu_holders_the_first_in_the_adapters_rendezvous_order_takes_the_job_while_it_has_room():
    ids = ["a", "b", "c", "d"]
    first, second, *_ = rendezvous_order("x", ids)
    # the other holder has more room: a copy of x there is not fed while the first holder has room
    workers = [worker(w, gpu=("x",), room=2 if w == first else 8) for w in (first, second)]
    assert place(MODEL, "x", workers, {}).worker == first
    assert place(MODEL, "x", workers, {first: 2}).worker == second  # what this gateway placed since counts


def test_among_host_holders_the_first_in_the_adapters_rendezvous_order_takes_the_job():
    ids = ["a", "b", "c", "d"]
    first, second, *_ = rendezvous_order("x", ids)
    workers = [worker(w, host=("x",), room=2 if w == first else 8) for w in (second, first)]
    assert place(MODEL, "x", workers, {}).worker == first


def test_a_job_on_a_holder_other_than_its_home_is_placed_away():
    ids = ["a", "b", "c", "d"]
    home, other, *_ = rendezvous_order("x", ids)
    route = place(MODEL, "x", [worker(w, gpu=("x",) if w == other else ()) for w in ids], {})
    assert (route.placement, route.worker, route.home, route.away) == (Placement.GPU, other, home, True)


def test_a_holder_without_room_is_passed_over_for_the_home():
    ids = ["a", "b", "c", "d"]
    holder = next(w for w in ids if w != home_of("x", ids))
    workers = [worker(w, gpu=("x",) if w == holder else (), room=0 if w == holder else 8) for w in ids]
    route = place(MODEL, "x", workers, {})
    assert (route.placement, route.worker) == (Placement.HOME, home_of("x", ids))


def test_an_unheld_adapter_goes_to_its_home_every_time():
    ids = ["a", "b", "c", "d"]
    workers = [worker(w) for w in ids]
    homes = {f"adapter-{i}": place(MODEL, f"adapter-{i}", workers, {}).worker for i in range(200)}
    assert all(home == home_of(adapter, ids) for adapter, home in homes.items())
    assert set(homes.values()) == set(ids)  # every worker is home to a share


def test_a_full_home_takes_the_job_while_less_than_its_slack_waits_past_its_capacity():
    ids = ["a", "b", "c"]
    home = home_of("x", ids)
    slack = int(HOME_SLACK * 16)
    workers = [worker(w, room=1 - slack if w == home else 8) for w in ids]  # one job short of its slack
    route = place(MODEL, "x", workers, {})
    assert (route.placement, route.worker, route.away) == (Placement.HOME, home, False)
    assert place(MODEL, "x", workers, {home: 1}).placement is Placement.SPILL  # what this gateway placed counts


def test_a_home_at_its_slack_spills_to_the_worker_with_most_room():
    ids = ["a", "b", "c"]
    home = home_of("x", ids)
    workers = [worker(w, room=-int(HOME_SLACK * 16) if w == home else 3 + (w == "c")) for w in ids]
    route = place(MODEL, "x", workers, {})
    assert (route.placement, route.home, route.away) == (Placement.SPILL, home, True)
    assert route.worker == max((w for w in ids if w != home), key=lambda w: 3 + (w == "c"))


def test_a_full_fleet_queues_the_backlog_on_the_adapters_home_while_its_load_is_under_the_bound():
    ids = ["a", "b", "c", "d"]
    full = [worker(w, room=-4) for w in ids]  # every worker 4 jobs past its capacity of 16: load 20
    route = place(MODEL, "x", full, {})
    assert (route.placement, route.worker) == (Placement.BACKLOG, home_of("x", ids))
    assert route.queue == keys.worker_queue(MODEL, home_of("x", ids))  # never the shared stream


def test_a_backlog_job_passes_a_home_over_the_bound_to_the_next_worker_of_the_adapters_rendezvous_order():
    ids = ["a", "b", "c", "d"]
    first, second, *_ = rendezvous_order("x", ids)
    # loads 16 everywhere but the home's 30: the mean with this job is (3 * 16 + 30 + 1) / 4 = 19.75, the
    # bound 1.25 times that = 24.7; the home is over it, the next one is not
    workers = [worker(w, room=-14 if w == first else 0) for w in ids]
    assert place(MODEL, "x", workers, {}).worker == second
    # what this gateway placed counts: with 14 more jobs on the second (load 30, bound 1.25 * 93 / 4 = 29.1),
    # the third in the order takes it
    assert place(MODEL, "x", workers, {second: 14}).worker == rendezvous_order("x", ids)[2]


def test_a_backlog_job_goes_to_a_holder_of_its_adapter_within_the_bound_before_its_home():
    ids = ["a", "b", "c"]
    holder = next(w for w in ids if w != home_of("x", ids))
    full = [worker(w, room=-4, gpu=("x",) if w == holder else ()) for w in ids]  # each at its home slack
    assert (place(MODEL, "x", full, {}).worker, place(MODEL, "x", full, {}).placement) == (holder, Placement.BACKLOG)


def test_a_backlog_job_goes_to_the_first_of_its_adapters_holders_in_its_rendezvous_order():
    ids = ["a", "b", "c", "d"]
    order = rendezvous_order("x", ids)
    holders = order[1:]  # every worker but the home holds x; the list's order is not the rendezvous order
    full = [worker(w, room=-4, gpu=("x",) if w in holders else ()) for w in sorted(ids, reverse=True)]
    assert place(MODEL, "x", full, {}).worker == holders[0]


def test_the_backlog_never_leaves_a_worker_with_more_than_the_bound_while_another_has_less():
    ids = [f"w{i}" for i in range(4)]
    placed: dict[str, int] = {}
    full = [worker(w, room=0) for w in ids]
    for index in range(400):  # a burst of one popular adapter's jobs onto a full fleet
        route = place(MODEL, "hot" if index % 2 else f"adapter-{index}", full, placed)
        placed[route.worker] = placed.get(route.worker, 0) + 1
    loads = [16 + placed.get(w, 0) for w in ids]
    assert max(loads) <= BALANCE * sum(loads) / len(ids) + 1


def test_a_worker_joining_or_leaving_moves_only_its_share_of_adapters():
    adapters = [f"adapter-{i}" for i in range(1000)]
    before = {a: home_of(a, ["a", "b", "c", "d"]) for a in adapters}
    joined = {a: home_of(a, ["a", "b", "c", "d", "e"]) for a in adapters}
    moved = [a for a in adapters if before[a] != joined[a]]
    assert all(joined[a] == "e" for a in moved)  # only to the newcomer
    assert 100 < len(moved) < 300  # about a fifth
    left = {a: home_of(a, ["a", "b", "d"]) for a in adapters}
    assert all(left[a] == before[a] for a in adapters if before[a] != "c")  # only the leaver's adapters move


async def test_the_fleet_view_routes_from_heartbeat_records_and_ignores_workers_whose_record_expired(aredis):
    for worker_id, gpu in (("w1", ["x"]), ("w2", [])):
        await aredis.sadd(keys.WORKERS, worker_id)
        await aredis.hset(
            keys.worker(worker_id),
            mapping={
                "adapters": json.dumps({MODEL: {"gpu": gpu, "cpu": []}}),
                "capacity": 16,
                "in_flight": 0,
                "routed_waiting": json.dumps({MODEL: 0}),
            },
        )
    await aredis.sadd(keys.WORKERS, "gone")  # listed, but its record expired
    registry = CollectorRegistry()
    placed = Counter("placed", "", ["model", "placement"], registry=registry)
    away = Counter("away", "", ["model", "placement"], registry=registry)
    fleet = FleetView(aredis, placed, away, refresh_s=0)

    route = await fleet.route(MODEL, "x")
    other = await fleet.route("another-model", "x")  # no worker has it resident

    assert (route.placement, route.worker) == (Placement.GPU, "w1")
    assert other.placement is Placement.SHARED
    assert registry.get_sample_value("placed_total", {"model": MODEL, "placement": "gpu"}) == 1
    # x's home is w2 (rendezvous), so the job on w1, which holds it, was placed away
    assert home_of("x", ["w1", "w2"]) == "w2"
    assert registry.get_sample_value("away_total", {"model": MODEL, "placement": "gpu"}) == 1


async def test_jobs_placed_since_a_heartbeat_count_against_its_room_until_a_newer_heartbeat_counts_them(aredis):
    """A re-read that finds the same heartbeat must not forget what this gateway placed since it."""
    beat_ms = int(time.time() * 1000) - 100

    async def beat(worker_id: str, room: int, updated_ms: int) -> None:
        await aredis.sadd(keys.WORKERS, worker_id)
        await aredis.hset(
            keys.worker(worker_id),
            mapping={
                "adapters": json.dumps({MODEL: {"gpu": ["u"] if worker_id == "holder" else [], "cpu": []}}),
                "capacity": 16,
                "in_flight": 16 - room,
                "routed_waiting": json.dumps({MODEL: 0}),
                "updated_ms": updated_ms,
            },
        )

    await beat("holder", 2, beat_ms)
    await beat("other", 16, beat_ms)
    registry = CollectorRegistry()
    counters = [Counter(name, "", ["model", "placement"], registry=registry) for name in ("placed", "away")]
    fleet = FleetView(aredis, *counters, refresh_s=0)

    # refresh_s=0: every route re-reads the records, which still say what the first read said; u's home is
    # "other", which takes u's jobs once the holder has no room
    assert home_of("u", ["holder", "other"]) == "other"
    routes = [await fleet.route(MODEL, "u") for _ in range(3)]
    assert [r.worker for r in routes] == ["holder", "holder", "other"]

    await beat("holder", 2, int(time.time() * 1000) + 1)  # a newer heartbeat: it counts what was placed
    assert (await fleet.route(MODEL, "u")).worker == "holder"
