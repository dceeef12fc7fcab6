"""The supervisor behind `lorafleet up`: children stop on SIGTERM or are killed after the grace period,
with their own children; a dead child is noticed; nothing outlives a supervisor that was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli.supervisor import RESTART_MIN_S, STEADY_S, Child, Supervisor

REPO_ROOT = Path(__file__).resolve().parents[2]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


@pytest.fixture
def supervisor():
    supervisor = Supervisor()
    yield supervisor
    supervisor.stop_all(grace_s=0.0)


def test_stop_all_ends_children_with_sigterm(supervisor: Supervisor) -> None:
    child = supervisor.start("sleeper", python("import time; time.sleep(60)"), dict(os.environ))
    supervisor.stop_all(grace_s=10.0)
    assert child.exit_code == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(supervisor: Supervisor, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").write("1")
        time.sleep(60)
    """
    child = supervisor.start("stubborn", python(code), dict(os.environ))
    wait_for_file(ready)
    started = time.monotonic()
    supervisor.stop_all(grace_s=0.5)
    assert child.exit_code == -signal.SIGKILL
    assert 0.4 < time.monotonic() - started < 5.0


def test_stopping_a_child_stops_the_processes_it_started(supervisor: Supervisor, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    code = f"""
        import subprocess, time
        grandchild = subprocess.Popen(["sleep", "60"])
        open({str(pid_file)!r}, "w").write(str(grandchild.pid))
        time.sleep(60)
    """
    supervisor.start("parent", python(code), dict(os.environ))
    grandchild = int(wait_for_file(pid_file))
    supervisor.stop_all(grace_s=10.0)
    deadline = time.monotonic() + 5
    while is_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(grandchild)


def test_first_exited_names_the_child_that_died(supervisor: Supervisor) -> None:
    supervisor.start("steady", python("import time; time.sleep(60)"), dict(os.environ))
    crashing = supervisor.start("crashing", python("raise SystemExit(3)"), dict(os.environ))
    crashing.process.wait(10)
    assert supervisor.first_exited() is crashing
    assert crashing.exit_code == 3


def test_a_signal_requests_a_stop_and_a_second_one_forces_it(tmp_path: Path) -> None:
    supervisor = Supervisor()
    previous = signal.getsignal(signal.SIGTERM)
    ready = tmp_path / "ready"
    with supervisor.signals_handled():
        assert not supervisor.wait(0.0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert supervisor.wait(5.0)
        os.kill(os.getpid(), signal.SIGINT)
        # forced: a child that ignores SIGTERM is killed without waiting for the grace period
        code = f"import signal, time; signal.signal(15, 1); open({str(ready)!r}, 'w').write('1'); time.sleep(60)"
        child = supervisor.start("stubborn", python(code), {})
        wait_for_file(ready)
        started = time.monotonic()
        supervisor.stop_all(grace_s=30.0)
        assert time.monotonic() - started < 5.0
        assert child.exit_code == -signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
def test_children_do_not_outlive_a_supervisor_that_was_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    code = f"""
        import os, time
        from cli.supervisor import Supervisor
        child = Supervisor().start("child", ["sleep", "60"], dict(os.environ))
        open({str(pid_file)!r}, "w").write(str(child.process.pid))
        time.sleep(60)
    """
    supervisor_process = subprocess.Popen(python(code), cwd=REPO_ROOT)
    try:
        child = int(wait_for_file(pid_file))
        supervisor_process.kill()
        supervisor_process.wait()
        deadline = time.monotonic() + 5
        while is_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(child)
    finally:
        supervisor_process.kill()


def restarted(supervisor: Supervisor, child: Child, pid: int, timeout_s: float = 10.0) -> None:
    """Drive the supervisor's watch until `child` runs as another process than `pid`."""
    deadline = time.monotonic() + timeout_s
    while child.process.pid == pid:
        assert time.monotonic() < deadline, f"{child.name} was not restarted"
        supervisor.restart_exited()
        time.sleep(0.01)


def test_a_killed_child_is_restarted_with_the_same_command(supervisor: Supervisor, tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    code = f"import time; open({str(starts)!r}, 'a').write('x'); time.sleep(60)"
    child = supervisor.start("worker", python(code), dict(os.environ))
    wait_for_file(starts)
    first = child.process.pid
    os.kill(first, signal.SIGKILL)

    restarted(supervisor, child, first)

    assert child.exit_code is None and supervisor.first_exited() is None
    deadline = time.monotonic() + 10
    while starts.read_text() != "xx":
        assert time.monotonic() < deadline, "the restarted child never ran its command"
        time.sleep(0.02)


def test_a_child_that_keeps_dying_is_restarted_after_a_doubling_wait(supervisor: Supervisor) -> None:
    child = supervisor.start("crashing", python("raise SystemExit(3)"), dict(os.environ))
    child.backoff_s = 0.2  # the first wait; the supervisor's own is 1 s
    waits = []
    for _ in range(3):
        child.process.wait(10)
        supervisor.restart_exited()  # notices the death
        noticed, pid = time.monotonic(), child.process.pid
        restarted(supervisor, child, pid)
        waits.append(time.monotonic() - noticed)
    assert waits[0] >= 0.2 and waits[1] >= 0.4 and waits[2] >= 0.8
    assert child.backoff_s == 1.6


def test_the_wait_starts_over_for_a_child_that_ran_steadily_before_it_died(supervisor: Supervisor) -> None:
    child = supervisor.start("steady", python("import time; time.sleep(60)"), dict(os.environ))
    child.backoff_s = 16.0  # as after several quick deaths
    child.started -= STEADY_S  # it has run for a minute
    os.kill(child.process.pid, signal.SIGKILL)
    child.process.wait(10)
    supervisor.restart_exited()
    assert child.restart_at is not None and child.restart_at - time.monotonic() <= RESTART_MIN_S
