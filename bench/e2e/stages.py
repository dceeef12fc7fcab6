"""Where the stack's added latency goes: each request's way through the stack, stage by stage, beside the
same requests replayed into the engine alone.

The stack's points come from the client (planned arrival, its end event), the job record's trace
(shared/schema.py JobTrace: the gateway's creation, the worker's read, start, the engine thread's
intake, first and last token, the I/O loop taking the result); the engine alone's from its results'
stamps (worker/engine/engine.py EngineResult), the same clock readings the worker's engine takes. All
are seconds since the run's start, on one machine's clock (unix time in the worker and the gateway,
the client's perf_counter anchored to unix time at the run's start).

Per stage the table gives the p50 and the mean of both and their difference. Means add up to the
mean latency; p50s of stages need not add up to the p50 latency, but the stage whose p50 grew is
where the added p50 went.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.e2e.client import Sample
from shared.schema import JobTrace
from worker.engine.engine_request import EngineResult


@dataclass(frozen=True, slots=True)
class RequestPoints:
    """One successful request's points, seconds since its run's start (None: that path has no such point)."""

    scheduled: float  # its planned arrival
    created: float | None  # the gateway made the job
    read: float | None  # the worker read its entry
    started: float | None  # the worker's start script returned
    engine: float  # the engine took it
    first_token: float  # the engine read its first token
    last_token: float  # the engine ended it
    out: float | None  # the worker's I/O loop took the result
    client_first_token: float  # the client saw the first token (engine alone: the replay's step end)
    end: float  # the client read the end (engine alone: the replay's step end)


def stack_points(samples: list[Sample], traces: dict[str, JobTrace], start_unix_s: float) -> list[RequestPoints]:
    """The stack run's requests that succeeded and have a complete trace."""

    def at(unix_us: int) -> float:
        return unix_us / 1e6 - start_unix_s

    points = []
    for sample in samples:
        trace = traces.get(sample.job_id)
        if not sample.ok or trace is None or not all(getattr(trace, point) for point in JobTrace.FIELDS):
            continue
        point = RequestPoints(
            sample.scheduled_s, at(trace.created), at(trace.read), at(trace.started), at(trace.engine),
            at(trace.first_token), at(trace.last_token), at(trace.out), sample.first_token_s, sample.end_s,
        )  # fmt: skip
        points.append(point)
    return points


def engine_points(samples: list[Sample], results: dict[int, EngineResult], start_unix_s: float) -> list[RequestPoints]:
    """The engine-alone replay's requests that succeeded (`results` by the sample's index)."""
    points = []
    for sample in samples:
        result = results.get(sample.index)
        if not sample.ok or result is None or not result.first_token_at:
            continue
        point = RequestPoints(
            sample.scheduled_s, None, None, None, result.added_at - start_unix_s,
            result.first_token_at - start_unix_s, result.finished_at - start_unix_s, None,
            sample.first_token_s, sample.end_s,
        )  # fmt: skip
        points.append(point)
    return points


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    stack: Callable[[RequestPoints], float]
    alone: Callable[[RequestPoints], float] | None  # None: the engine alone has no such stage (0)


# In the order a request meets them; their means add up to the mean latency.
STAGES = (
    Stage("client → job created (send lag, HTTP, auth, tokenize, create script)", lambda p: p.created - p.scheduled,
          None),
    Stage("created → worker read it (Redis stream, XREADGROUP)", lambda p: p.read - p.created, None),
    Stage("read → started (start script)", lambda p: p.started - p.read, None),
    Stage("started → in the engine (engine alone: arrival → in the engine)", lambda p: p.engine - p.started,
          lambda p: p.engine - p.scheduled),
    Stage("in the engine → first token", lambda p: p.first_token - p.engine, lambda p: p.first_token - p.engine),
    Stage("first token → last token", lambda p: p.last_token - p.first_token, lambda p: p.last_token - p.first_token),
    Stage("last token → I/O loop took the result", lambda p: p.out - p.last_token, None),
    Stage("I/O loop → client read the end (finish script, end event, gateway, SSE)", lambda p: p.end - p.out,
          lambda p: p.end - p.last_token),
)  # fmt: skip
LATENCY = Stage("latency: arrival → end", lambda p: p.end - p.scheduled, lambda p: p.end - p.scheduled)
FIRST_TOKEN_DELIVERY = Stage(
    "first token: engine → client (worker, Redis, gateway, SSE)", lambda p: p.client_first_token - p.first_token,
    lambda p: p.client_first_token - p.first_token,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StageRow:
    name: str
    stack_p50_ms: float
    alone_p50_ms: float
    stack_mean_ms: float
    alone_mean_ms: float

    @property
    def added_p50_ms(self) -> float:
        return self.stack_p50_ms - self.alone_p50_ms

    @property
    def added_mean_ms(self) -> float:
        return self.stack_mean_ms - self.alone_mean_ms


def _stats_ms(points: list[RequestPoints], of: Callable[[RequestPoints], float] | None) -> tuple[float, float]:
    """(p50, mean) of a stage in ms; (0, 0) for a stage this path does not have; nan without requests."""
    if not points:
        return math.nan, math.nan
    if of is None:
        return 0.0, 0.0
    values = np.array([1000 * of(p) for p in points])
    return float(np.percentile(values, 50)), float(values.mean())


def stage_rows(stack: list[RequestPoints], alone: list[RequestPoints]) -> list[StageRow]:
    rows = []
    for stage in (*STAGES, LATENCY, FIRST_TOKEN_DELIVERY):
        (stack_p50, stack_mean), (alone_p50, alone_mean) = _stats_ms(stack, stage.stack), _stats_ms(alone, stage.alone)
        rows.append(StageRow(stage.name, stack_p50, alone_p50, stack_mean, alone_mean))
    return rows


def stage_table(rows: list[StageRow], stack_requests: int, alone_requests: int) -> str:
    lines = [
        f"| stage ({stack_requests} requests in the stack, {alone_requests} alone) | stack p50 ms | alone p50 ms "
        "| added p50 ms | stack mean ms | alone mean ms | added mean ms |",
        "| --- " + "| ---: " * 6 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.stack_p50_ms:.2f} | {r.alone_p50_ms:.2f} | {r.added_p50_ms:+.2f} | {r.stack_mean_ms:.2f} "
            f"| {r.alone_mean_ms:.2f} | {r.added_mean_ms:+.2f} |"
        )
    return "\n".join(lines)
