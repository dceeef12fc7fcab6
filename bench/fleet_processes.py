"""The fleet bench's processes (one gateway, the workers): their flags and logs, the waits on them, none
of which can hang silently, and the bench's progress lines.

`start_fleet` starts a fleet's gateway (routing on for the routed design) and its workers with the
bench's flags, and returns once all are up. Every wait is bounded and, while it waits, checks that each
process of the fleet is still running: a worker that exits (a crash at start, a CUDA error mid-run)
fails the bench at once, unless the bench killed it on purpose (`Fleet.kill`, the `--kill` run). A
failure is a `FleetError` whose message ends with the tail of the log of the process that died, or of
every process where a wait ran out of time. The logs stay in the fleet's log directory either way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.fleet_workload import MODEL
from bench.local_http import answers_ok
from cli.redis_server import free_port
from shared import keys
from worker.model.lora_linear import PAGE_RANK

REPO_ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 40
STOP_GRACE_S = 30.0  # a worker's SIGTERM drain; then SIGKILL
PROGRESS_EVERY_S = 30.0
# the workers' --max-lora-rank: one pool page per slot, so --max-loras (--pool) is the adapters a GPU tier
# holds; at the default 64 a slot is 4 pages, and 4 rank-4 adapters fit in each (a pool of 128, not 32)
SLOT_RANK = PAGE_RANK
GATEWAY_FLAGS = [
    "--requests-per-min", "100000000", "--tokens-per-min", "1000000000",
    "--max-concurrent-jobs", "1000000", "--max-queue-per-model", "1000000",
]  # fmt: skip
STARTED = time.monotonic()


def say(message: str) -> None:
    """A progress line, stamped with the seconds since the bench started (flushed: a time limit may cut it)."""
    print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", flush=True)


class FleetError(RuntimeError):
    """The fleet failed (a process died, a wait ran out); the message carries the relevant log tails."""


def log_tail(log: Path, lines: int = TAIL_LINES) -> str:
    if not log.exists():
        return "(no log)"
    text = log.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text) if text else "(empty log)"


@dataclass
class Child:
    """One `python -m cli ...` process and its log (stdout and stderr together)."""

    name: str
    popen: subprocess.Popen
    log: Path

    def report(self) -> str:
        return f"--- {self.name} ({self.log}), last {TAIL_LINES} lines:\n{log_tail(self.log)}"


@dataclass
class Fleet:
    """The fleet's processes, started by `spawn` and stopped together on exit (SIGTERM, then SIGKILL)."""

    log_dir: Path
    children: dict[str, Child] = field(default_factory=dict)
    expected_exits: set[str] = field(default_factory=set)  # killed by the bench on purpose

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `python -m cli *args` from the repository with this process's environment (PYTHONPATH,
        CUDA_VISIBLE_DEVICES, CUDA_MPS_*, NCCL_* pass through), plus `env`."""
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # the repository first, so `-m cli` finds this checkout from any working directory
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as sink:
            popen = subprocess.Popen(
                [sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, env=child_env, stdout=sink,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.children[name] = child = Child(name, popen, log)
        return child

    def kill(self, name: str) -> None:
        """SIGKILL `name`, as a machine that dies; its exit no longer fails the waits."""
        self.expected_exits.add(name)
        self.children[name].popen.send_signal(signal.SIGKILL)

    def check_alive(self) -> None:
        """Raise FleetError, with its log's tail, if a process exited that the bench did not kill."""
        for child in self.children.values():
            code = child.popen.poll()
            if code is not None and child.name not in self.expected_exits:
                raise FleetError(f"{child.name} exited with code {code}\n{child.report()}")

    def reports(self) -> str:
        return "\n".join(child.report() for child in self.children.values())

    def wait_for(
        self, condition: Callable[[], bool], timeout_s: float, what: str, progress: Callable[[], str] | None = None
    ) -> float:
        """Poll `condition` until true, for at most `timeout_s`; returns the seconds it took. Every
        PROGRESS_EVERY_S, prints `progress()` (what is done so far). Fails at once if a process died."""
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        while not condition():
            self.check_alive()
            now = time.monotonic()
            if now - start > timeout_s:
                done = f" ({progress()})" if progress is not None else ""
                raise FleetError(f"timed out after {timeout_s:.0f} s waiting for {what}{done}\n{self.reports()}")
            if progress is not None and now >= next_progress:
                print(f"    ... {what}: {progress()} after {now - start:.0f} s", flush=True)
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(0.1)
        return time.monotonic() - start

    def stop(self) -> None:
        """SIGTERM every process still running (the workers drain), SIGKILL those past the grace period."""
        for child in self.children.values():
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children.values():
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is not None and not isinstance(exc, FleetError):
                # a failure of the bench itself (a refused submit, SIGTERM from a time limit): what the
                # processes were doing is the first thing to know
                print(f"the fleet failed ({exc_type.__name__}: {exc}); its processes' logs:\n{self.reports()}",
                      file=sys.stderr, flush=True)  # fmt: skip
        finally:
            self.stop()


def worker_flags(args, redis_url: str, model_dir: Path, adapter_root: Path, worker: str) -> list[str]:
    """`lorafleet worker` flags of one worker of the fleet; `--worker-flag`s last, so they win."""
    flags = [
        "worker", "--redis-url", redis_url, "--model", f"{MODEL}={model_dir}", "--adapter-root",
        str(adapter_root), "--worker-id", worker, "--device", args.device, "--max-loras", str(args.pool),
        "--max-lora-rank", str(SLOT_RANK),
        "--max-num-seqs", str(args.max_num_seqs), "--heartbeat-interval", str(args.heartbeat),
        "--claim-idle-ms", str(int(args.heartbeat * 4000)), "--steal-after-ms", str(args.steal_after_ms),
        # no start-up tune of the LoRA plans (the packaged tables have none for the demo model's shapes): it
        # would take up to its 120 s budget at every fleet's start, both workers tuning against each other on
        # one GPU, and both designs run on the same plans either way
        "--kernel-tune-budget-s", "0",
    ]  # fmt: skip
    if args.gpu_memory_fraction:
        flags += ["--gpu-memory-fraction", str(args.gpu_memory_fraction)]
    return flags + [flag for extra in args.worker_flag for flag in extra.split()]


def start_fleet(args, fleet: Fleet, redis_url: str, assets: tuple[Path, Path], workers: list[str], design: str,
                label: str) -> str:  # fmt: skip
    """Start the gateway (routing on for `design` "routed") and the workers; return the gateway's URL once it
    answers and every worker has announced itself. `label`: the fleet's name in progress lines."""
    model_dir, adapter_root = assets
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    routing = "on" if design == "routed" else "off"
    fleet.spawn("gateway", ["gateway", "--redis-url", redis_url, "--port", str(port), "--adapter-routing", routing,
                            *GATEWAY_FLAGS])  # fmt: skip
    # on CPU one intra-op thread a worker (bench/fleet.py's docstring says why)
    worker_env = {"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {}
    for worker in workers:
        fleet.spawn(worker, worker_flags(args, redis_url, model_dir, adapter_root, worker), worker_env)
    start = time.monotonic()
    ready: dict[str, float] = {}
    with redis.Redis.from_url(redis_url) as client:

        def all_ready() -> bool:
            for worker in workers:
                if worker not in ready and client.exists(keys.worker(worker)):
                    ready[worker] = time.monotonic() - start
            return len(ready) == len(workers) and answers_ok(f"{url}/healthz")

        fleet.wait_for(all_ready, args.start_timeout_s, f"{label}: the gateway and {len(workers)} workers to start",
                       lambda: f"workers ready: {sorted(ready) or 'none'}")  # fmt: skip
    each = ", ".join(f"{worker} {ready[worker]:.0f} s" for worker in workers)
    say(f"{label}: fleet started, {len(workers)} workers ready in {time.monotonic() - start:.0f} s ({each})")
    return url
