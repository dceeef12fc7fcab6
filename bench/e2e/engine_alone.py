"""The same requests into an in-process LLMEngine, with no gateway, Redis or worker process around it.

Built from the model directory exactly as the worker builds it (ModelResidency with the same
EngineConfig) and driven the way the worker's engine thread drives it, on a thread of its own:
requests are added at their planned arrival times and the engine steps while it has work, each step
timed and recorded in the engine's metrics as the engine thread records it (worker/engine_thread.py),
so its step count and mean step time read as the stack's worker's do. A request's first token is
the end of the step that produced it, its end the end of its last step. The difference from the
stack's latencies on the same plan is what the gateway, Redis, the worker's I/O loop and the
client's HTTP/SSE add; the difference in step time, what the engine loses inside the worker.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from bench.e2e.client import Sample
from bench.e2e.traffic import PlannedRequest
from shared.schema import SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest, EngineResult

T = TypeVar("T")


def _engine_request(request: PlannedRequest, job_id: str) -> EngineRequest:
    if request.adapter is not None:
        raise ValueError("the engine-alone replay serves base-only plans (it has no adapter registry)")
    return EngineRequest(
        job_id=job_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
        tenant=request.tenant,
    )


def on_engine_thread(work: Callable[[], T]) -> T:
    """Run `work` on a thread of its own, as the worker runs its engine. (On a CPU this is not a detail:
    torch's intra-op threads cost a step ~40x more from the main thread than from a worker thread
    when the machine's cores are busy, measured on the 2-core CI machine.)"""
    with ThreadPoolExecutor(1, thread_name_prefix="engine") as pool:
        return pool.submit(work).result()


def run_to_completion(engine: LLMEngine, requests: list[PlannedRequest]) -> None:
    """Add every request at once and step until all finish (a warm-up)."""
    for request in requests:
        engine.add(_engine_request(request, f"warmup-{request.index}"))
    while engine.num_unfinished:
        engine.step()
        engine.take_deltas()


def keep_busy(engine: LLMEngine, requests: Iterator[PlannedRequest], concurrency: int, seconds: float) -> None:
    """Keep `concurrency` requests in the engine for `seconds`, then let them finish, measuring nothing:
    the device heated as the stack's closed-loop calibration heats it before its load runs."""
    deadline = time.perf_counter() + seconds
    while engine.num_unfinished or time.perf_counter() < deadline:
        while engine.num_unfinished < concurrency and time.perf_counter() < deadline:
            request = next(requests)
            failed = engine.add(_engine_request(request, f"heat-{request.index}"))
            if failed is not None:
                raise RuntimeError(f"a heating request failed: {failed.status.value}")
        engine.step()
        engine.take_deltas()


@dataclass(frozen=True, slots=True)
class Replay:
    samples: list[Sample]  # one per planned request, times since the replay's start
    results: dict[int, EngineResult]  # by the request's index: the engine's own stamps (unix s)
    start_unix_s: float  # the replay's start


def replay(engine: LLMEngine, plan: list[PlannedRequest]) -> Replay:
    """Serve `plan` in real time."""
    samples = {str(r.index): Sample(r.index, r.adapter, r.at_s) for r in plan}
    ended: dict[int, EngineResult] = {}
    arrivals = deque(plan)
    start, start_unix_s = time.perf_counter(), time.time()
    while arrivals or engine.num_unfinished:
        now = time.perf_counter() - start
        while arrivals and arrivals[0].at_s <= now:
            request = arrivals.popleft()
            sample = samples[str(request.index)]
            sample.sent_s = sample.accepted_s = now
            failed = engine.add(_engine_request(request, str(request.index)))
            if failed is not None:
                sample.status, sample.end_s = failed.status.value, now
                ended[request.index] = failed
        if not engine.num_unfinished:
            if arrivals:
                time.sleep(max(0.0, arrivals[0].at_s - (time.perf_counter() - start)))
            continue
        stepped = time.perf_counter()
        results = engine.step()
        done = time.perf_counter()
        engine.metrics.record_step(engine.last_step, engine.load(), done - stepped)
        done -= start
        for delta in engine.take_deltas():
            sample = samples[delta.job_id]
            if sample.first_token_s is None:
                sample.first_token_s = done
        for result in results:
            sample = samples[result.job_id]
            sample.end_s, sample.status, sample.completion_tokens = done, result.status.value, result.completion_tokens
            if sample.first_token_s is None and result.completion_tokens:
                sample.first_token_s = done
            ended[sample.index] = result
    return Replay(list(samples.values()), ended, start_unix_s)
