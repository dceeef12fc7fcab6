"""Runs the engines' step loop on its own thread, so the asyncio loop does only I/O.

Commands (add, abort, call, stop) arrive through a thread-safe queue; what each step produced (its token
deltas for streaming and its finished results) leaves as one StepOutput through a callback that the asyncio
side makes thread-safe: one hand-over, and one wake-up of the I/O loop, per step. With
several base models, each engine that has work gets one step in turn. Each step is timed and recorded
into the engine's metrics here (prometheus_client is thread-safe; the HTTP server reads them).

`call` runs a function on this thread between steps: a model switch changes the engines there,
never during a step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import structlog

from shared.schema import TokenDelta
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest, EngineResult

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Add:
    model: str
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class _Abort:
    job_id: str


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[dict[str, LLMEngine]], object]
    future: Future


class _Stop:
    pass


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced: a stream's tokens (deltas) precede its end (results) when published in order."""

    deltas: list[TokenDelta]
    results: list[EngineResult]


class EngineThread:
    def __init__(
        self,
        engines: dict[str, LLMEngine],
        on_output: Callable[[StepOutput], None],
        on_crash: Callable[[BaseException], None],
    ) -> None:
        self.engines = engines
        self._on_output = on_output
        self._on_crash = on_crash
        self._inbox: queue.Queue[_Add | _Abort | _Call | _Stop] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, model: str, request: EngineRequest) -> None:
        self._inbox.put(_Add(model, request))

    def abort(self, job_id: str) -> None:
        self._inbox.put(_Abort(job_id))

    def call(self, fn: Callable[[dict[str, LLMEngine]], object]) -> Future:
        """Run `fn(engines)` on the engine thread between steps; the future holds its result or error."""
        future: Future = Future()
        self._inbox.put(_Call(fn, future))
        return future

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(_Stop())
        self._thread.join(timeout_s)

    def _busy(self) -> bool:
        return any(engine.num_unfinished for engine in self.engines.values())

    def _run(self) -> None:
        try:
            for engine in self.engines.values():
                engine.metrics.record_load(engine.load())  # sizes are known before the first step
            while True:
                # block only while idle; with work in flight, take whatever commands are waiting
                command = self._inbox.get() if not self._busy() else self._next_nowait()
                while command is not None:
                    if isinstance(command, _Stop):
                        return
                    self._apply(command)
                    command = self._next_nowait()
                for engine in self.engines.values():
                    if engine.num_unfinished:
                        started = time.perf_counter()
                        results = engine.step()
                        engine.metrics.record_step(engine.last_step, engine.load(), time.perf_counter() - started)
                        deltas = engine.take_deltas()
                        if deltas or results:
                            self._on_output(StepOutput(deltas, results))
        except BaseException as exc:  # the worker must not keep reading jobs it can no longer run
            log.exception("engine_thread_crashed")
            self._on_crash(exc)

    def _next_nowait(self) -> _Add | _Abort | _Call | _Stop | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Call):
            try:
                command.future.set_result(command.fn(self.engines))
            except Exception as exc:  # the caller decides; the engines step on
                command.future.set_exception(exc)
        elif isinstance(command, _Add):
            immediate = self.engines[command.model].add(command.request)
            if immediate is not None:
                self._on_output(StepOutput([], [immediate]))
        else:
            for engine in self.engines.values():
                if engine.abort(command.job_id):
                    break
