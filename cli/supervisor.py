"""Child processes of `lorafleet up`: start them, restart one that died, stop them all.

A child that dies once the fleet runs is started again with the same command after a backoff: 1 s,
doubling at each quick death up to 30 s, and 1 s again for a child that had run a minute or more. A
worker's jobs survive it (another worker, or the restarted one, claims its entries), so one crash
must not take the fleet down; a child that cannot start at all costs one try every 30 s.

Each child leads its own process group, so a Ctrl-C in the terminal reaches only the supervisor,
which then stops the children in order (SIGTERM to the group, a grace period, SIGKILL). On Linux a
child also gets SIGTERM if the supervisor itself is killed, so no orphan keeps a GPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog

from cli.parent_death import die_with_parent

log = structlog.get_logger(__name__)


RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
STEADY_S = 60.0  # a child that ran this long before it died is restarted after RESTART_MIN_S again


@dataclass(slots=True)
class Child:
    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    backoff_s: float = RESTART_MIN_S  # the wait before its next restart
    restart_at: float | None = None  # set once its death was noticed

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()


class Supervisor:
    """Owns the started children and the stop request that SIGINT / SIGTERM / SIGHUP make."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._stop = threading.Event()
        self._force = threading.Event()  # a second signal: kill now, skip the grace period

    @contextmanager
    def signals_handled(self) -> Iterator[None]:
        """Turn SIGINT, SIGTERM and SIGHUP into a stop request (a second one into a kill) while inside."""
        signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in signums}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True as soon as a stop was requested."""
        return self._stop.wait(seconds)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        child = Child(name, args, env, _spawn(args, env))
        self.children.append(child)
        log.info("started", child=name, pid=child.process.pid)
        return child

    def first_exited(self) -> Child | None:
        return next((child for child in self.children if child.exit_code is not None), None)

    def restart_exited(self) -> None:
        """Notice children that died (logged, with the wait before their restart) and restart those whose
        wait is over."""
        now = time.monotonic()
        for child in self.children:
            if child.exit_code is None:
                continue
            if child.restart_at is None:
                if now - child.started >= STEADY_S:
                    child.backoff_s = RESTART_MIN_S
                child.restart_at = now + child.backoff_s
                log.error("child_exited", child=child.name, exit_code=child.exit_code, restart_in_s=child.backoff_s)
            elif now >= child.restart_at:
                child.process = _spawn(child.args, child.env)
                child.started, child.restart_at = now, None
                child.backoff_s = min(2 * child.backoff_s, RESTART_MAX_S)
                log.warning("restarted", child=child.name, pid=child.process.pid)

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM every running child's process group, wait up to `grace_s`, then SIGKILL what is left."""
        running = [child for child in self.children if child.exit_code is None]
        for child in running:
            self._signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(child.exit_code is None for child in running):
            if time.monotonic() > deadline or self._force.is_set():
                break
            time.sleep(0.1)
        for child in running:
            if child.exit_code is None:
                log.warning("killing", child=child.name, pid=child.process.pid, grace_s=grace_s)
                self._signal_group(child, signal.SIGKILL)
            child.process.wait()
            log.info("stopped", child=child.name, exit_code=child.exit_code)

    @staticmethod
    def _signal_group(child: Child, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(child.process.pid, signum)


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        args, env=env, start_new_session=True, stdout=sys.stderr.fileno(), preexec_fn=die_with_parent()
    )
