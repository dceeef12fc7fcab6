"""What a serving model ran at during each stretch of a preparation beside it (torch-free).

bench.model_switch's overlap row gives one figure for the whole preparation (decode tok/s during it,
against before it). To tell *what* slows the serving model (issue #27), the preparing thread's
timeline (worker/engine/capture_pacer.py: each unit of work by kind, each rest, the stretches marked
between them) is laid over the serving model's steps (wall start and end of each `step()` call and
the tokens it sampled):

- a step's tokens are shared among the stretches it overlaps, in proportion to the overlap, so the
  tok/s of a kind is the tokens that fell in its stretches over their total seconds, and the rows
  add up to the whole window's figure;
- a step's wall time goes to the kind its midpoint falls in (the p50/p99 columns).

Time of the window that no stretch covers (the thread starting, anything the bench's loader does
outside the pacer's marks) is OUTSIDE.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.capture_pacer import Interval

OUTSIDE = "outside the pacer's timeline"


@dataclass(frozen=True, slots=True)
class Step:
    """One serving step: wall start and end (the pacer's clock, perf_counter seconds), tokens sampled."""

    start: float
    end: float
    tokens: int


@dataclass(frozen=True, slots=True)
class KindRow:
    kind: str
    seconds: float  # of the window spent in stretches of this kind
    tokens: float  # the serving model's tokens that fell in them
    steps: int  # serving steps whose midpoint fell in them
    step_p50_ms: float | None  # None: no step's midpoint fell in them
    step_p99_ms: float | None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def covering(timeline: Sequence[Interval], start: float, end: float) -> list[Interval]:
    """The timeline clipped to [start, end], its gaps filled with OUTSIDE stretches: in order,
    contiguous, covering the window. The timeline's intervals are in order and do not overlap."""
    covered: list[Interval] = []
    at = start
    for interval in timeline:
        lo, hi = max(interval.start, at), min(interval.end, end)
        if hi <= lo:
            continue
        if lo > at:
            covered.append(Interval(at, lo, OUTSIDE))
        covered.append(Interval(lo, hi, interval.kind))
        at = hi
    if at < end:
        covered.append(Interval(at, end, OUTSIDE))
    return covered


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of non-empty `values`."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def split_by_kind(steps: Sequence[Step], timeline: Sequence[Interval], start: float, end: float) -> list[KindRow]:
    """Per kind of stretch in the window [start, end] (first appearance first): its seconds, the
    serving tokens and steps that fell in it (module docstring). `steps` are in order."""
    stretches = covering(timeline, start, end)
    seconds: dict[str, float] = {}
    tokens: dict[str, float] = {}
    step_ms: dict[str, list[float]] = {}
    for stretch in stretches:
        seconds[stretch.kind] = seconds.get(stretch.kind, 0.0) + stretch.end - stretch.start
        tokens.setdefault(stretch.kind, 0.0)
        step_ms.setdefault(stretch.kind, [])
    starts = [stretch.start for stretch in stretches]
    for step in steps:
        duration = step.end - step.start
        middle = (step.start + step.end) / 2
        if not stretches or not start <= middle < end:
            continue
        step_ms[stretches[bisect.bisect_right(starts, middle) - 1].kind].append(duration * 1e3)
        first = max(0, bisect.bisect_right(starts, step.start) - 1)
        for stretch in stretches[first:]:
            if stretch.start >= step.end:
                break
            overlap = min(step.end, stretch.end) - max(step.start, stretch.start)
            if overlap > 0 and duration > 0:
                tokens[stretch.kind] += step.tokens * overlap / duration
    return [
        KindRow(
            kind,
            seconds[kind],
            tokens[kind],
            len(step_ms[kind]),
            percentile(step_ms[kind], 50) if step_ms[kind] else None,
            percentile(step_ms[kind], 99) if step_ms[kind] else None,
        )
        for kind in seconds
    ]


def tok_s_over_time(steps: Sequence[Step], start: float, end: float, parts: int) -> list[float]:
    """The serving tok/s in each of `parts` equal slices of [start, end] (a step's tokens shared by
    overlap, as split_by_kind shares them): whether the slowdown holds or drifts over the window."""
    width = (end - start) / parts
    tokens = [0.0] * parts
    for step in steps:
        duration = step.end - step.start
        if duration <= 0:
            continue
        first = max(0, int((step.start - start) // width))
        for part in range(first, min(parts, int((step.end - start) // width) + 1)):
            lo, hi = start + part * width, start + (part + 1) * width
            overlap = min(step.end, hi) - max(step.start, lo)
            if overlap > 0:
                tokens[part] += step.tokens * overlap / duration
    return [t / width for t in tokens]


def whole(steps: Sequence[Step], label: str) -> KindRow:
    """One row over every step of `steps` (the serving model alone, say): tokens over their span."""
    step_ms = [(step.end - step.start) * 1e3 for step in steps]
    return KindRow(
        label,
        steps[-1].end - steps[0].start,
        sum(step.tokens for step in steps),
        len(steps),
        percentile(step_ms, 50),
        percentile(step_ms, 99),
    )


def format_table(rows: Sequence[KindRow], alone: KindRow) -> str:
    """A markdown table: each kind's seconds, share of the window, serving tok/s and its ratio to
    `alone`, and the step times; `alone` first, the whole window last."""
    window = sum(row.seconds for row in rows)
    total = KindRow(
        "whole preparation",
        window,
        sum(row.tokens for row in rows),
        sum(row.steps for row in rows),
        None,
        None,
    )

    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    lines = [
        "| serving model during | seconds | share | tok/s | × alone | steps | step p50 ms | step p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {alone.kind} | {alone.seconds:.2f} | – | {alone.tok_s:.0f} | 1.00 | {alone.steps} | "
        f"{ms(alone.step_p50_ms)} | {ms(alone.step_p99_ms)} |",
    ]
    for row in [*rows, total]:
        share = row.seconds / window if window > 0 else 0.0
        ratio = row.tok_s / alone.tok_s if alone.tok_s > 0 else 0.0
        lines.append(
            f"| {row.kind} | {row.seconds:.2f} | {share:.1%} | {row.tok_s:.0f} | {ratio:.2f} | {row.steps} | "
            f"{ms(row.step_p50_ms)} | {ms(row.step_p99_ms)} |"
        )
    return "\n".join(lines)
