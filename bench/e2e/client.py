"""The load generator: each request is `POST /v1/jobs`, then `GET /v1/jobs/{id}/events` (server-sent
events) read to its `end` event. Time to first token is when the first `token` event arrives.

Open loop: a request is sent at its planned arrival whether or not earlier ones have finished, so
a saturated stack shows up as growing latency rather than as a slower client. Closed loop (for
calibration): `concurrency` requests in flight at all times, each replaced when it ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp

from bench.e2e.traffic import PlannedRequest

_CLOSED_LOOP_REQUEST_S = 120.0  # a calibration request taking longer than this means the stack is stuck


@dataclass(slots=True)
class Sample:
    """One request as the client saw it. Times are seconds since the run's start (perf_counter)."""

    index: int
    adapter: str | None
    scheduled_s: float  # planned arrival
    sent_s: float = 0.0
    accepted_s: float | None = None  # the 202 arrived
    first_token_s: float | None = None
    end_s: float | None = None
    status: str = "unfinished"  # the job's final status, or what went wrong before it had one
    completion_tokens: int = 0
    job_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def latency_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.scheduled_s


@dataclass(slots=True)
class RunRecord:
    samples: list[Sample]
    token_times_s: list[float]  # every token event's arrival, for throughput over time
    start_unix_s: float  # wall-clock time of the run's start (to line up with job records' unix ms)
    probes: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (s, the stack's gauges), 1/s


def _event(block: bytes) -> tuple[bytes, bytes]:
    """(event type, data) of one server-sent event's lines (b"" where it has none: a keep-alive comment)."""
    event = data = b""
    for line in block.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(b"event: "):
            event = line[7:]
        elif line.startswith(b"data: "):
            data = line[6:]
    return event, data


class LoadClient:
    def __init__(self, gateway_urls: list[str], api_keys: dict[str, str], model: str) -> None:
        self.gateway_urls = gateway_urls
        self.api_keys = api_keys
        self.model = model

    def _body(self, request: PlannedRequest) -> dict:
        body = {
            "model": self.model,
            "prompt": request.prompt_text,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,  # the worker publishes each token as an event (else the events are the end alone)
        }
        if request.adapter is not None:
            body["adapter"] = request.adapter
        return body

    async def _one(
        self, session: aiohttp.ClientSession, request: PlannedRequest, sample: Sample, clock: Callable[[], float],
        token_times: list[float],
    ) -> None:  # fmt: skip
        url = self.gateway_urls[request.index % len(self.gateway_urls)]
        headers = {"Authorization": f"Bearer {self.api_keys[request.tenant]}"}
        sample.sent_s = clock()
        async with session.post(f"{url}/v1/jobs", json=self._body(request), headers=headers) as response:
            if response.status != 202:
                sample.status = f"http_{response.status}"
                sample.end_s = clock()
                return
            sample.job_id = (await response.json())["id"]
        sample.accepted_s = clock()
        async with session.get(f"{url}/v1/jobs/{sample.job_id}/events", headers=headers) as response:
            if response.status != 200:
                sample.status = f"events_http_{response.status}"
                return
            pending, streamed = b"", 0
            # read as it arrives and split into events here: one await per chunk (an event or a few), where a
            # read per line (four per event) cost this one process's loop ~4,000 events/s at the GPU's loads
            async for chunk in response.content.iter_any():
                now = clock()
                *events, pending = (pending + chunk).split(b"\n\n")
                for event, data in map(_event, events):
                    if event == b"token":
                        token_times.append(now)
                        streamed += 1
                        if sample.first_token_s is None:
                            sample.first_token_s = now
                    elif event == b"end":
                        sample.end_s = now
                        body = json.loads(data)
                        sample.status = body["status"] if body else "expired"
                        sample.completion_tokens = (body or {}).get("usage", {}).get("completion_tokens", 0)
                        # the last token has no event of its own: it arrives with the end
                        token_times.extend([sample.end_s] * max(0, sample.completion_tokens - streamed))
                        if sample.first_token_s is None and sample.completion_tokens:
                            sample.first_token_s = sample.end_s
                        return

    async def _guarded(
        self, session: aiohttp.ClientSession, request: PlannedRequest, sample: Sample, clock: Callable[[], float],
        token_times: list[float],
    ) -> None:  # fmt: skip
        """`_one`, with a broken connection or a malformed answer recorded as the sample's status."""
        try:
            await self._one(session, request, sample, clock, token_times)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            sample.status = f"error:{type(exc).__name__}"

    async def open_loop(
        self, plan: list[PlannedRequest], drain_s: float, probe: Callable[[], dict[str, float]]
    ) -> RunRecord:
        """Send every planned request at its arrival time; wait up to `drain_s` after the last arrival
        for the stragglers, then cancel what is left (status stays "unfinished") so the next run
        starts on an empty queue. `probe` (blocking; run on a thread) is read once a second."""
        start = time.perf_counter()
        record = RunRecord([Sample(r.index, r.adapter, r.at_s) for r in plan], [], time.time())

        def clock() -> float:
            return time.perf_counter() - start

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            sampler = asyncio.create_task(self._sample(probe, clock, record.probes))
            tasks = []
            for request, sample in zip(plan, record.samples, strict=True):
                delay = request.at_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._guarded(session, request, sample, clock, record.token_times_s)))
            if tasks:
                await asyncio.wait(tasks, timeout=drain_s)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._cancel_unfinished(session, plan, record.samples)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        return record

    async def closed_loop(
        self, requests: Iterator[PlannedRequest], concurrency: int, duration_s: float,
        probe: Callable[[], dict[str, float]],
    ) -> RunRecord:  # fmt: skip
        """Keep `concurrency` requests in flight for `duration_s` (ramping up over its first third),
        then let the last ones finish."""
        start = time.perf_counter()
        record = RunRecord([], [], time.time())

        def clock() -> float:
            return time.perf_counter() - start

        timeout = aiohttp.ClientTimeout(total=_CLOSED_LOOP_REQUEST_S)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

            async def lane(number: int) -> None:
                # lanes start spread over the first third, so requests do not start and end in lockstep
                await asyncio.sleep(number / concurrency * duration_s / 3)
                while clock() < duration_s:
                    request = next(requests)
                    sample = Sample(len(record.samples), request.adapter, clock())
                    record.samples.append(sample)
                    await self._guarded(session, request, sample, clock, record.token_times_s)

            sampler = asyncio.create_task(self._sample(probe, clock, record.probes))
            await asyncio.gather(*(lane(number) for number in range(concurrency)))
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        return record

    async def _sample(
        self, probe: Callable[[], dict[str, float]], clock: Callable[[], float],
        into: list[tuple[float, dict[str, float]]],
    ) -> None:  # fmt: skip
        while True:
            into.append((clock(), await asyncio.to_thread(probe)))
            await asyncio.sleep(1.0)

    async def _cancel_unfinished(
        self, session: aiohttp.ClientSession, plan: list[PlannedRequest], samples: list[Sample]
    ) -> None:
        for request, sample in zip(plan, samples, strict=True):
            if sample.end_s is None and sample.job_id:
                url = self.gateway_urls[request.index % len(self.gateway_urls)]
                headers = {"Authorization": f"Bearer {self.api_keys[request.tenant]}"}
                async with session.post(f"{url}/v1/jobs/{sample.job_id}/cancel", headers=headers) as response:
                    await response.read()
