"""A fleet, not N copies: adapter-aware routing against the shared stream, each on its own fresh fleet.

(a) CPU (default): the random-weight demo model, N worker processes (`--workers 2,4,8`), `--adapters`
registered adapters (rank 4), Zipf(`--zipf`) traffic over one popularity order per fleet (its warm-up,
burst and arrivals share their popular adapters), each worker's GPU tier `--pool` adapters. Per worker
count and design (routing on; routing off: every job on the shared stream, the design before), a
fresh fleet (Redis, one gateway, N workers) first takes `--warmup` jobs (not measured: the caches
reach their steady state, past the compulsory misses), then a burst of `--jobs` jobs at once
(saturation throughput), then `--jobs` open-loop Poisson arrivals at `--load` of the shared design's
saturation throughput (waits p50/p99: created to read by a worker, the figure recorded before, and
created to first token, the wait a job has before it is served; and end-to-end p99: created to
finished). Over the burst and the arrivals, the GPU-tier hit rate (the tier each job's adapter was
in when its worker read it) and how jobs arrived (routed / shared / stolen / reclaimed), from the
workers' heartbeats. The designs alternate over `--repeats` (shared first, then routed first, ...)
so that a machine shared with other work loads both alike; the ratios are the medians over repeats.

The read wait leaves out what a job waits inside its worker: a worker reads up to twice its batch
(`--max-num-seqs`), so on the shared stream a job is read by whichever worker has read-ahead room and
then waits in that worker's engine, while a routed job waits on its own worker's stream. The wait to
the first token (the jobs' traces, shared/schema.py JobTrace) counts both alike; the p99 wait target
is judged on it. Its last part, in the engine to the first token (the prefill, with what the engine
ran before it; p50), is printed beside it.
`--kill` then kills one worker -9 mid-run in the last routed fleet and counts lost jobs.

On CPU each worker runs one intra-op thread (OMP_NUM_THREADS=1): N processes on a few cores with
torch's default (a thread per core each) spin against each other, and a worker whose asyncio loop
waits for a core reads its own stream late, which the shared stream hides (any worker may read it).

(b) GPU: `--device cuda --workers 2 --gpu-memory-fraction 0.45` runs two workers on one GPU; start
the MPS control daemon first (deploy/mps/) and export its CUDA_MPS_PIPE_DIRECTORY in the bench's shell
(the workers inherit the bench's environment, and the bench prints what they get). The workload is
the same as on CPU: the random-weight demo model (4 layers, hidden 256), 8-token jobs. What a GPU fleet
costs is its start, paid twice (a fresh fleet per design): CUDA and MPS client set-up, Triton's first
compiles (cached for the second fleet), and the CUDA graphs: decode graphs for 1-8 sequences, and
piecewise prefill graphs for a ladder of token counts up to --max-num-batched-tokens (26 buckets at the
default 2,048, 6 at 128). So on the GPU each worker also gets `--max-num-batched-tokens 128` (a step
here runs at most 8 sequences of a few-token prompt: the limit never binds, only the capture shrinks)
and `--num-kv-blocks 4096` (a sequence needs one 16-token block; the default would carve ~35 GB of
KV cache per worker out of its 45 %). Whatever their start costs, the jobs are the CPU run's:
600 warm-up jobs bring both designs' GPU tiers past their compulsory misses, and the burst, the
arrivals at 80 % of the shared fleet's saturation and the kill -9 measure the hit rate, throughput,
p99 wait and lost jobs the targets name. With 10-minute device calls:

    export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
    bash deploy/mps/start.sh
    timeout -k 30 480 python3 -m bench.fleet --device cuda --workers 2 --gpu-memory-fraction 0.45 \
        --adapters 1000 --jobs 400 --warmup 600 --repeats 1 --kill --start-timeout-s 180 --phase-timeout-s 120 \
        --worker-flag='--max-num-batched-tokens 128 --num-kv-blocks 4096' --logs-dir "$OUT/fleet"

The workers tune no LoRA plans at start (`--kernel-tune-budget-s 0`; the packaged tables have none
for the demo model's shapes, so each start would tune for up to 120 s, two workers against each other
on one GPU, and both designs run on the same plans either way; `--worker-flag` overrides it).
Every wait is bounded (`--start-timeout-s`, `--phase-timeout-s`), a worker that exits fails the bench at
once (but the one `--kill` kills), a failure prints the log tails of the fleet's processes (as does a
SIGTERM from an outer `timeout`), and a progress line marks each phase (bench/fleet_processes.py).

    python -m bench.fleet --workers 2,4,8 --adapters 1000 --jobs 400 --warmup 600 --repeats 2 --kill
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.fleet_phases import run_design
from bench.fleet_processes import STARTED, FleetError, say
from bench.fleet_report import RATIOS, print_header, print_phase, print_ratios, routed_over_shared
from bench.fleet_workload import write_assets

TARGETS = (
    "hit rate (4 workers) >= 1.6x shared; throughput >= shared; p99 wait (created to first token) <= 1.2x shared"
    " at the load; 0 lost"
)


def run_fleet(args, assets: tuple[Path, Path], n_workers: int, log_dir: Path) -> None:
    """Both designs with `n_workers`, alternating over the repeats; a table row per design and repeat."""
    print_header(args, n_workers)
    rate: float | None = None  # set by the first fleet (shared): the load is a share of its saturation
    ratios: dict[str, list[float]] = {name: [] for name in RATIOS}
    for repeat in range(args.repeats):
        designs = ("shared", "routed") if repeat % 2 == 0 else ("routed", "shared")
        phases = {}
        for design in designs:
            kill = args.kill and design == "routed" and repeat == args.repeats - 1
            phase = run_design(args, assets, n_workers, design, rate, log_dir / f"{design}-{repeat}", kill=kill)
            rate = phase.rate
            phases[design] = phase
            print_phase(repeat, design, phase)
        for name, ratio in routed_over_shared(phases["shared"], phases["routed"]).items():
            ratios[name].append(ratio)
    print_ratios(ratios, args.repeats)


class Terminated(Exception):
    """SIGTERM (an outer `timeout`): raised where the bench is, so the fleet's logs are printed on the way out."""


def on_sigterm(signum, frame) -> None:
    raise Terminated("terminated by SIGTERM (a time limit?)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4,8", help="worker counts to run, comma-separated")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=32, help="adapters in each worker's GPU tier (--max-loras)")
    parser.add_argument("--jobs", type=int, default=400, help="jobs per measured phase (the burst, the arrivals)")
    parser.add_argument("--warmup", type=int, default=600, help="jobs each fleet takes before it is measured")
    parser.add_argument("--repeats", type=int, default=2, help="fleets per design, the designs alternating")
    parser.add_argument("--load", type=float, default=0.8, help="offered load, of the shared design's saturation")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--steal-after-ms", type=int, default=500)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-fraction", type=float, help="each worker's share of the GPU (part b)")
    parser.add_argument("--kill", action="store_true", help="then kill a worker -9 mid-run, routing on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs-dir", type=Path, help="keep the fleets' logs here (default: a new temporary directory)")
    parser.add_argument(
        "--start-timeout-s",
        type=float,
        default=300.0,
        help="a fleet's gateway and workers must be up within this (default: %(default)s)",
    )
    parser.add_argument(
        "--phase-timeout-s",
        type=float,
        default=600.0,
        help="the jobs of each phase (warm-up, burst, arrivals) must finish within this (default: %(default)s)",
    )
    parser.add_argument("--worker-flag", action="append", default=[], metavar="FLAGS",
                        help="more `lorafleet worker` flags for every worker, after the bench's own (repeatable), "
                             "e.g. --worker-flag='--kernel-tune-budget-s 120'")  # fmt: skip
    args = parser.parse_args(argv)
    previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    logs = args.logs_dir.resolve() if args.logs_dir else tmp
    logs.mkdir(parents=True, exist_ok=True)
    say(f"logs: {logs}")
    if args.device.startswith("cuda"):
        shown = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")  # fmt: skip
        say("the workers' GPU environment: " + ", ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in shown))
    try:
        assets = write_assets(tmp, args.adapters)
        for n in (int(part) for part in args.workers.split(",")):
            run_fleet(args, assets, n, logs / f"fleet-{n}")
    except (FleetError, Terminated) as exc:
        print(f"bench.fleet FAILED after {time.monotonic() - STARTED:.0f} s: {exc}\nlogs: {logs}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        shutil.rmtree(tmp / "adapters", ignore_errors=True)
        shutil.rmtree(tmp / "model", ignore_errors=True)
    print(f"targets: {TARGETS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
