"""Rebalancing through the running stack: a worker joining or leaving moves only its share of the adapters.

Each adapter's jobs run on its consistent-hash home among the live workers (gateway/routing.py). A
worker that joins takes the adapters whose home it becomes, and only those, as they come to it cold;
an adapter another worker holds stays where it is held (placement prefers a holder, so a join costs
no cold load). A worker that leaves, drained by SIGTERM or killed -9 and gone when its heartbeat
expires, gives its adapters to their homes among the others, and every job, in flight across the
leave or not, gets exactly one stored result. The assertions are on the worker each job record says
served it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest

from cli.demo_adapters import DEMO_ADAPTERS
from gateway.routing import rendezvous_rank
from shared import keys
from shared.adapter_registry import register_adapter
from shared.model_info import ModelInfo
from shared.redis_client import plain_redis
from shared.schema import JobRecord
from tests.e2e.processes import wait_until
from tests.fleet import HEARTBEAT_S, MODEL, TENANT, Fleet

pytestmark = pytest.mark.slow

# never stolen while a test watches where jobs run: a steal is a decision of load, not of placement
WORKER_FLAGS = ("--steal-after-ms", "5000")
# the gateway re-reads heartbeats every 0.25 s and workers beat every HEARTBEAT_S: what a placement
# after a join or a leave must wait for the gateway to see
FLEET_VIEW_S = 0.25 + 2 * HEARTBEAT_S


def register_adapters(fleet: Fleet, count: int, prefix: str) -> dict[str, str]:
    """`count` adapters of the demo tenant (the demo adapter's files under new names: each its own
    identity, as a new adapter is); returns name → uid, the identity routing hashes."""

    async def run() -> dict[str, str]:
        info = ModelInfo.from_pretrained(MODEL, fleet.model_dir)
        uids = {}
        async with plain_redis(fleet.redis_url) as client:
            for index in range(count):
                record = await register_adapter(
                    client, name=f"{prefix}{index:02d}", tenant=TENANT, model=info, adapter_root=fleet.adapter_root,
                    path=DEMO_ADAPTERS[0].path(MODEL), max_rank=64, max_bytes=1 << 30,
                )  # fmt: skip
                uids[record.name] = record.ref().uid
        return uids

    return asyncio.run(run())


def homes(uids: dict[str, str], workers: list[str]) -> dict[str, str]:
    """Adapter name → its rendezvous home among `workers`."""
    return {name: max(workers, key=lambda worker: rendezvous_rank(uid, worker)) for name, uid in uids.items()}


def run_each(fleet: Fleet, names: list[str], max_tokens: int = 2) -> dict[str, str]:
    """One job per adapter, submitted at once; returns adapter → the worker its job's record names."""
    records = submit_each(fleet, names, max_tokens, wait=True)
    return {record.adapter: record.worker for record in records}


def submit_each(fleet: Fleet, names: list[str], max_tokens: int, *, wait: bool) -> list[JobRecord]:
    jobs = [{"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "adapter": n} for n in names]
    job_ids = fleet.submit(jobs)
    records = fleet.wait_finished(job_ids, timeout_s=60) if wait else fleet.records(job_ids)
    if wait:
        fleet.assert_nothing_lost(job_ids, records)
    return records


def start_workers(fleet: Fleet, *names: str) -> dict[str, subprocess.Popen]:
    processes = {name: fleet.start_worker(name, *WORKER_FLAGS) for name in names}
    time.sleep(FLEET_VIEW_S)  # every one of them in the gateway's view of the fleet
    return processes


def test_a_joining_worker_takes_only_the_adapters_whose_home_it_becomes(fleet: Fleet):
    fleet.start_gateway()
    start_workers(fleet, "w1", "w2")
    warm = register_adapters(fleet, 12, "warm")  # run before the join: held by their homes
    cold = register_adapters(fleet, 12, "cold")  # first run after it
    before = homes(warm, ["w1", "w2"])
    assert run_each(fleet, list(warm)) == before

    start_workers(fleet, "w3")
    after = run_each(fleet, [*warm, *cold])

    cold_homes = homes(cold, ["w1", "w2", "w3"])
    moved = {name for name, home in homes(warm, ["w1", "w2", "w3"]).items() if home == "w3"}
    assert moved and {n for n, h in cold_homes.items() if h == "w3"} and {n for n, h in cold_homes.items() if h != "w3"}
    # a cold adapter runs on its home among the three: the newcomer's share goes to it, and only that share
    assert {name: after[name] for name in cold} == cold_homes
    # a held adapter stays with its holder, including those whose home is now the newcomer
    assert {name: after[name] for name in warm} == before


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_a_leaving_workers_adapters_move_to_their_homes_among_the_others_and_no_job_is_lost(fleet: Fleet, how: str):
    fleet.start_gateway()
    processes = start_workers(fleet, "w1", "w2", "w3")
    adapters = register_adapters(fleet, 12, "a")
    busy = register_adapters(fleet, 6, "busy")  # the leaver's jobs in flight when it goes (their adapters
    # end up on whichever worker re-runs them, so the placements after the leave are checked on `adapters`)
    before = homes(adapters, ["w1", "w2", "w3"])
    assert run_each(fleet, list(adapters)) == before
    leaving = [name for name, home in before.items() if home == "w3"]
    on_leaver = [name for name, home in homes(busy, ["w1", "w2", "w3"]).items() if home == "w3"]
    assert leaving and len(leaving) < len(adapters) and on_leaver

    in_flight = submit_each(fleet, on_leaver * 6, max_tokens=64, wait=False)  # running and queued on w3
    wait_until(lambda: fleet.running_on("w3", [r.job_id for r in in_flight]) >= 1, timeout_s=30, what="w3 to run")
    with fleet.redis() as client:
        if how == "sigterm":
            processes["w3"].send_signal(signal.SIGTERM)
            assert processes["w3"].wait(30) == 0
        else:
            processes["w3"].send_signal(signal.SIGKILL)
            processes["w3"].wait(10)
            # placed on its stream while its heartbeat lives; the others adopt them once it has expired
            in_flight += submit_each(fleet, on_leaver, max_tokens=2, wait=False)
            wait_until(lambda: not client.exists(keys.worker("w3")), timeout_s=10, what="w3's heartbeat to expire")

    in_flight_ids = [r.job_id for r in in_flight]
    records = fleet.wait_finished(in_flight_ids, timeout_s=90)
    fleet.assert_nothing_lost(in_flight_ids, records)  # each succeeded, with exactly one stored result
    assert not any(r.worker == "w3" for r in records if r.attempts > 1)
    # placement is checked on an idle fleet: a home still running the leaver's adopted jobs past its
    # slack spills to the other worker by design (rule 4), which on 2 loaded cores it did
    time.sleep(FLEET_VIEW_S)

    after = run_each(fleet, list(adapters))
    # the leaver's share goes to each adapter's home among the others; the others' adapters stay
    assert after == homes(adapters, ["w1", "w2"])
    assert all(after[name] == before[name] for name in adapters if name not in leaving)
