"""bench/fleet.py on the CPU with real processes (Redis, a gateway, workers): a fleet that cannot start
or loses a worker fails at once with the log tail of the process that died, instead of waiting out its
time limit silently; and a small run measures both designs, routing on in the routed one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.fleet import main
from bench.fleet_processes import Fleet, FleetError
from cli.redis_server import free_port

pytestmark = pytest.mark.slow

SMALL = ["--device", "cpu", "--workers", "2", "--adapters", "20", "--repeats", "1"]


def test_a_worker_that_dies_at_start_fails_the_bench_at_once_with_its_log(tmp_path: Path, capsys):
    start = time.monotonic()
    code = main([*SMALL, "--jobs", "4", "--warmup", "4", "--worker-flag=--no-such-flag", "--logs-dir", str(tmp_path)])
    elapsed = time.monotonic() - start

    assert code == 1
    assert elapsed < 60, "the bench waited for workers that had exited"
    err = capsys.readouterr().err
    assert "FAILED" in err and "exited with code 2" in err
    assert "unrecognized arguments: --no-such-flag" in err  # the dead worker's log tail
    assert (tmp_path / "fleet-2" / "shared-0" / "w0.log").exists()  # the logs kept where asked


def test_a_wait_ends_when_a_process_exits_unless_the_bench_killed_it(tmp_path: Path, redis_url: str):
    with Fleet(tmp_path) as fleet:
        fleet.spawn("w0", ["worker", "--no-such-flag"])  # exits 2 at once
        with pytest.raises(FleetError, match="w0 exited with code 2") as failure:
            fleet.wait_for(lambda: False, 30, "nothing")
        assert "unrecognized arguments" in str(failure.value)

    with Fleet(tmp_path) as fleet:
        gateway = fleet.spawn("gateway", ["gateway", "--redis-url", redis_url, "--port", str(free_port())])
        fleet.kill("gateway")
        fleet.wait_for(lambda: gateway.popen.poll() is not None, 30, "the killed gateway to exit")
        fleet.check_alive()  # its exit was the bench's doing: no failure


def test_a_small_run_measures_both_designs_with_routing_on_in_the_routed_one(tmp_path: Path, capsys):
    assert main([*SMALL, "--jobs", "12", "--warmup", "8", "--kill", "--logs-dir", str(tmp_path)]) == 0

    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("  0 ")}
    assert set(rows) == {"shared", "routed"}
    assert "routed=" in rows["routed"] and "routed=" not in rows["shared"]
    assert "warm-up of 8 jobs done" in out and "arrivals done" in out
    assert "0 of 12 jobs lost" in out
