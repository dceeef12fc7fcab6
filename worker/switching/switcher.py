"""The worker's model switching loop (asyncio side): measures every served model's queue, asks the
policy, and carries a switch out without dropping or failing a request:

1. prepare the incoming model in a loader thread while the outgoing one keeps serving (weights onto
   the device on a side stream, then its KV cache over the outgoing model's KV storage and its decode
   graphs captured) — when its weights fit beside the resident models; otherwise this happens after
   the eviction in step 3 and the pause includes it;
2. stop reading and admitting the outgoing model's jobs; let its running ones finish for up to
   `switch_grace_s`, then abort the rest in the engine and hand them back to their stream (queued
   again, the attempt not counted) for whichever worker serves that model next;
3. hand-over on the engine thread, between two steps: evict the outgoing engine, activate the
   incoming one (an engine around the prepared runner); its stream is read from then on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import structlog
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.jobstore import now_ms
from worker.engine_thread import EngineThread
from worker.switching.queue_probe import QueueProbe
from worker.switching.residency import ModelResidency
from worker.switching.switch_policy import CandidateModel, ResidentModel, SwitchDecision, choose_switch

log = structlog.get_logger(__name__)

_CHECK_INTERVAL_S = 0.25
_DRAIN_POLL_S = 0.02
_FAILED_RETRY_S = 60.0  # a model that failed to load is not switched to again for this long


@dataclass(frozen=True, slots=True)
class SwitchRecord:
    """One switch as the heartbeat reports it (seconds)."""

    incoming: str
    outgoing: str | None
    overlapped: bool  # the incoming weights were copied while the outgoing model served
    prepare_s: float  # read (if cold) and copy of the incoming weights
    drain_s: float  # from admission stop to the outgoing model's last job finished or handed back
    pause_s: float  # from the outgoing model's end to the incoming one serving
    handed_back: int


class ModelSwitcher:
    def __init__(
        self,
        residency: ModelResidency,
        engine_thread: EngineThread,
        redis: Redis,
        *,
        claim_idle_ms: int,
        switch_grace_s: float,
        in_flight: Callable[[str], tuple[int, float]],
        hand_back: Callable[[str], Awaitable[int]],
        release_routed: Callable[[str], Awaitable[int]],
    ) -> None:
        """`in_flight(model)`: the worker's running jobs of `model` and their summed seconds since they
        started; `hand_back(model)`: abort them in the engine and queue them again, returning how many;
        `release_routed(model)`: move the jobs routed to this worker for `model` and not read yet to the
        model's shared stream (worker/routed_streams.py), where a worker serving it takes them."""
        self.residency = residency
        self._engine_thread = engine_thread
        self._queues = QueueProbe(redis, claim_idle_ms=claim_idle_ms)
        self._grace_s = switch_grace_s
        self._in_flight = in_flight
        self._hand_back = hand_back
        self._release_routed = release_routed
        self._draining: set[str] = set()
        self._failed_at: dict[str, float] = {}  # model → monotonic time its last load failed
        self.switches = 0
        self.last_switch: SwitchRecord | None = None

    def admitting(self, model: str) -> bool:
        """Whether this worker reads and starts `model`'s jobs now."""
        return model in self.residency.resident and model not in self._draining

    def readable(self) -> list[str]:
        return [name for name in self.residency.resident if name not in self._draining]

    def report(self) -> dict[str, object]:
        """Heartbeat fields: tiers and switch counts."""
        return {
            **self.residency.tiers(),
            "switches": self.switches,
            "last_switch": None if self.last_switch is None else asdict(self.last_switch),
        }

    async def run(self) -> None:
        """Decide and switch forever; meanwhile, read the cold models into the host cache as it has room
        (a switch need not wait for that)."""
        warm_up = asyncio.create_task(self._warm_up(), name="warm-up")
        try:
            await self._switch_when_worth_it()  # a lost Redis connection ends it: the caller retries
        finally:
            warm_up.cancel()

    async def _warm_up(self) -> None:
        for name in self.residency.specs:
            if name in self.residency.resident:
                continue
            try:
                await asyncio.to_thread(self.residency.warm_up, name)
            except Exception as exc:  # it stays cold; a switch to it reads it again and fails its jobs' way
                log.warning("model_warm_up_failed", model=name, error=f"{type(exc).__name__}: {exc}")

    async def _switch_when_worth_it(self) -> None:
        while True:
            decision = await self._decide()
            # a cancellation that lands inside a Redis command can be swallowed (shared/tasks.py says how):
            # without this the probe loop would run on after its worker asked it to stop
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            if decision is None:
                await asyncio.sleep(_CHECK_INTERVAL_S)
                continue
            log.info("model_switch", incoming=decision.incoming, outgoing=decision.outgoing, why=decision.reason)
            try:
                record = await self._switch(decision)
            except (RedisConnectionError, RedisTimeoutError):
                raise
            except Exception:  # a checkpoint that cannot load must not stop the worker serving the others
                log.exception("model_switch_failed", incoming=decision.incoming, outgoing=decision.outgoing)
                self._failed_at[decision.incoming] = time.monotonic()
                self._draining.discard(decision.outgoing)  # still resident unless it was already evicted
                continue
            self.switches += 1
            self.last_switch = record
            log.info("model_switched", **asdict(record))

    async def _decide(self) -> SwitchDecision | None:
        now = now_ms()
        queues = {name: await self._queues.measure(name, now_ms=now) for name in self.residency.specs}
        resident = self.residency.resident
        since = self.residency.resident_since
        residents = [
            ResidentModel(name, queues[name], *self._in_flight(name), time.monotonic() - since.get(name, 0.0))
            for name in resident
        ]
        now_s = time.monotonic()
        candidates = [
            CandidateModel(name, queues[name], self.residency.switch_cost_s(name))
            for name in self.residency.specs
            if name not in resident and now_s - self._failed_at.get(name, -_FAILED_RETRY_S) >= _FAILED_RETRY_S
        ]
        return choose_switch(residents, candidates, free_slots=self.residency.slots - len(resident))

    async def _switch(self, decision: SwitchDecision) -> SwitchRecord:
        incoming, outgoing = decision.incoming, decision.outgoing
        overlapped = self.residency.fits_beside_resident(incoming)
        prepared = None
        prepare_s = 0.0
        if overlapped:
            started = time.perf_counter()
            prepared = await asyncio.to_thread(self.residency.prepare, incoming, outgoing)
            prepare_s = time.perf_counter() - started
        drain_s, handed_back = 0.0, 0
        if outgoing is not None:
            drain_s, handed_back = await self._drain(outgoing)
        paused = time.perf_counter()
        if prepared is None:
            if outgoing is not None:
                await asyncio.wrap_future(self._engine_thread.call(lambda _: self.residency.evict(outgoing)))
            prepared = await asyncio.to_thread(self.residency.prepare, incoming)
            prepare_s = time.perf_counter() - paused
            await asyncio.wrap_future(self._engine_thread.call(lambda _: self.residency.activate(prepared)))
        else:

            def hand_over(_: object) -> None:
                if outgoing is not None:
                    self.residency.evict(outgoing)
                self.residency.activate(prepared)

            await asyncio.wrap_future(self._engine_thread.call(hand_over))
        pause_s = time.perf_counter() - paused
        self._draining.discard(outgoing)
        return SwitchRecord(incoming, outgoing, overlapped, prepare_s, drain_s, pause_s, handed_back)

    async def _drain(self, outgoing: str) -> tuple[float, int]:
        """Stop admitting `outgoing`; wait for its running jobs up to the grace, then hand back the rest."""
        self._draining.add(outgoing)
        started = time.perf_counter()
        # not read from now on: jobs the gateway routed here before the heartbeat said so go to the others
        await self._release_routed(outgoing)
        while self._in_flight(outgoing)[0] and time.perf_counter() - started < self._grace_s:
            await asyncio.sleep(_DRAIN_POLL_S)
        handed_back = await self._hand_back(outgoing) if self._in_flight(outgoing)[0] else 0
        return time.perf_counter() - started, handed_back
