"""The fleet bench's measurements of one design (`Phase`) and what it prints of them: per worker count a
header, a table row per design and repeat (with where its jobs ran, and what a kill -9 lost), and the
routed/shared ratios, medians over the repeats.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.fleet_placement import PlacementSplit

RATIOS = ("hit", "throughput", "read p99", "first-token p99")  # routed/shared, per repeat


@dataclass
class Phase:
    """One design's measurements in one fleet."""

    throughput: float = 0.0  # jobs/s of the burst
    wait_p50_ms: float = 0.0  # of the arrivals: created → read by a worker
    wait_p99_ms: float = 0.0
    served_p50_ms: float = 0.0  # of the arrivals: created → first token (the trace's stamps)
    served_p99_ms: float = 0.0
    in_engine_p50_ms: float = 0.0  # of the arrivals: into the engine → first token (prefill, and steps before it)
    latency_p99_ms: float = 0.0  # of the arrivals: created → finished
    rate: float = 0.0  # jobs/s the arrivals were offered at
    killed: str = ""  # with --kill: what a worker killed -9 mid-run lost
    counts: dict[str, int] | None = None  # arrival/tier → jobs started, over the burst and the arrivals
    split: PlacementSplit | None = None  # where the burst's and the arrivals' jobs ran (bench/fleet_placement.py)

    def tier_share(self, tier: str) -> float:
        with_adapter = {k: n for k, n in (self.counts or {}).items() if not k.endswith("/none")}
        total = sum(with_adapter.values())
        return sum(n for k, n in with_adapter.items() if k.endswith(f"/{tier}")) / total if total else 0.0

    def arrivals(self) -> str:
        by: dict[str, int] = {}
        for key, n in (self.counts or {}).items():
            by[key.split("/")[0]] = by.get(key.split("/")[0], 0) + n
        return " ".join(f"{k}={v}" for k, v in sorted(by.items()))


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def print_header(args: argparse.Namespace, n_workers: int) -> None:
    """The workload of `n_workers`' fleets and the table's column names."""
    print(f"\n{n_workers} workers, {args.adapters} adapters, Zipf({args.zipf}), pool {args.pool}, warm-up "
          f"{args.warmup} jobs, then {args.jobs} jobs per phase")  # fmt: skip
    print(f"{'':52} {'read wait':>16} {'first-token wait':>16} {'in engine':>9}")
    print(f"{'rep':>3} {'design':8} {'gpu hit':>8} {'host':>6} {'disk':>6} {'jobs/s':>8} {'load/s':>7}"
          f" {'p50 ms':>8} {'p99 ms':>7} {'p50 ms':>8} {'p99 ms':>7} {'p50 ms':>8}"
          f" {'e2e p99':>8}  arrivals")  # fmt: skip


def print_phase(repeat: int, design: str, phase: Phase) -> None:
    """`design`'s row of `repeat`, then where its jobs ran and, with --kill, what the kill lost."""
    print(
        f"{repeat:>3} {design:8} {phase.tier_share('gpu'):8.1%} {phase.tier_share('cpu'):6.1%}"
        f" {phase.tier_share('disk'):6.1%} {phase.throughput:8.1f} {phase.rate:7.1f} {phase.wait_p50_ms:8.0f}"
        f" {phase.wait_p99_ms:7.0f} {phase.served_p50_ms:8.0f} {phase.served_p99_ms:7.0f}"
        f" {phase.in_engine_p50_ms:8.1f} {phase.latency_p99_ms:8.0f}  {phase.arrivals()}",
        flush=True,
    )
    print(f"{'':12} {phase.split.describe() if phase.split else ''}", flush=True)
    if phase.killed:
        print(phase.killed, flush=True)


def routed_over_shared(shared: Phase, routed: Phase) -> dict[str, float]:
    """One repeat's ratios, keyed by RATIOS."""
    return {
        "hit": routed.tier_share("gpu") / max(1e-9, shared.tier_share("gpu")),
        "throughput": routed.throughput / shared.throughput,
        "read p99": routed.wait_p99_ms / max(1.0, shared.wait_p99_ms),
        "first-token p99": routed.served_p99_ms / max(1.0, shared.served_p99_ms),
    }


def print_ratios(ratios: dict[str, list[float]], repeats: int) -> None:
    """The medians over the repeats of each ratio in RATIOS (`ratios`: its value per repeat), then each repeat's."""
    each = " ".join("/".join(f"{r:.2f}" for r in repeat) for repeat in zip(*ratios.values(), strict=True))
    print(f"routed/shared, median of {repeats}: hit rate x{median(ratios['hit']):.2f}, "
          f"throughput x{median(ratios['throughput']):.2f}, read-wait p99 x{median(ratios['read p99']):.2f} "
          f"(the figure recorded before), first-token-wait p99 x{median(ratios['first-token p99']):.2f} "
          f"(the target's) (each repeat, {'/'.join(ratios)}: {each})")  # fmt: skip
