"""Children that do not outlive the process that started them, even when it is killed (SIGKILL leaves
it no chance to stop them): on Linux the kernel sends them SIGTERM when their parent dies."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies.
    (The parent is the forking *thread*: start such children from a thread that lives as long as they do.)"""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent() -> Callable[[], None] | None:
    """The `preexec_fn` for subprocess.Popen that makes the child die with us; None off Linux."""
    return _die_with_parent if sys.platform == "linux" else None
