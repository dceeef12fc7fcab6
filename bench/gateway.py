"""Gateway submit throughput and latency beside a bare aiohttp handler, and Redis work per request (CPU only).

    python -m bench.gateway [--concurrency 64] [--rounds 3] [--seconds 10] [--poll-seconds 5]

Starts a private redis-server, a real gateway process (`lorafleet gateway`: the same code, with its
Redis client's send path wrapped to count round trips) and a bare aiohttp process that answers every
POST with a constant 202. This process is the load generator (aiohttp, `concurrency` requests in
flight, after a warm-up) and runs `rounds` rounds of, in order (alternating, so that a change in
the shared machine's load hits the baseline and the gateway alike):
    bare    POST / to the bare handler                       (the baseline: aiohttp's own cost here)
    submit  POST /v1/jobs, a short text prompt on the demo model (no worker: jobs stay queued)
    poll    GET /v1/jobs/{id} of finished jobs
Per phase: requests/s (median of rounds), p50/p99 latency (all rounds), the gateway's rate over the
bare handler's of the same round (median and range), and per request the server process's CPU time
(user + system, from /proc: what the request costs whatever else the shared machine runs), the Redis
round trips (client side: one per command or pipeline sent, counted in the gateway; the gateway
auto-pipelines, so concurrent requests share sends and this can be below 1, while each request
still waits on one round trip) and Redis commands (server side: INFO commandstats, including those
Lua scripts run).
Targets (issue #7): submit >= 0.5x the bare handler's requests/s; <= 3 round trips per submit;
<= 1 per poll of a finished job.

    python -m bench.gateway --replica [...]

adds a replica beside the Redis and runs the gateway with `--redis-wait-replicas 1`: every submit is
then answered once the replica has the job (one WAIT per auto-pipelined batch). Compare its submit
rate, latency and commands with a run without it: the difference is what the guarantee costs
(docs/reliability.md).

    python -m bench.gateway --instructions [--rounds 1 --seconds 5 --poll-seconds 5]

runs both servers under callgrind (valgrind must be installed) and reports the instructions each
executes per request, counted only while a phase's load runs: steady to about 2% from run to run,
where CPU time per request on a shared machine moves by 15% or more with its load, so it is the
figure to compare two versions of the gateway by. The servers run ~50x slower there: such a run's
rates, latencies and ratios mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from cli.demo_model import write_demo_model
from cli.redis_server import RedisServer, free_port
from shared.jobstore import JobStore
from shared.model_info import ModelInfo
from shared.model_registry import publish_model
from shared.schema import FinishReason, JobOutput, JobStatus
from shared.tenants import create_tenant

MODEL = "demo"
PROMPT = "Once upon a time there was"
# admission must not be what this measures: limits far above what the run can reach
UNLIMITED = ["--requests-per-min", "1000000000", "--tokens-per-min", "1000000000000"]
UNLIMITED += ["--max-concurrent-jobs", "1000000000", "--max-queue-per-model", "1000000000"]
_local = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- the two server processes ------------------------------------------------------------------------


def serve_bare(port: int) -> None:
    """An aiohttp app whose one handler reads the body and returns a constant 202 JSON answer."""
    from aiohttp import web

    body = json.dumps({"id": "job_" + "0" * 32, "status": "queued"}).encode()

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, status=202, content_type="application/json")

    app = web.Application()
    app.router.add_post("/", handler)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_gateway(count_file: Path, gateway_args: list[str]) -> None:
    """`lorafleet gateway` with a round-trip counter on its Redis connections; SIGUSR1 writes the count to
    `count_file`. A round trip is one send: a command, or a whole pipeline (redis-py sends those at once)."""
    from redis.asyncio.connection import AbstractConnection

    sends = 0
    send = AbstractConnection.send_packed_command

    async def counted(self: AbstractConnection, command: object, check_health: bool = True) -> None:
        nonlocal sends
        sends += 1
        await send(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]

    def write_count(*_: object) -> None:
        partial = count_file.with_suffix(".partial")
        partial.write_text(str(sends))
        partial.replace(count_file)  # atomically: the reader never sees a half-written number

    signal.signal(signal.SIGUSR1, write_count)
    from cli.main import main

    sys.exit(main(["gateway", *gateway_args]))  # default logging: a JSON line per request, as deployed


# -- load generation -----------------------------------------------------------------------------------


@dataclass
class Phase:
    """One kind of request, measured over several rounds."""

    name: str
    rates: list[float] = field(default_factory=list)  # requests/s, one per round
    latencies_ms: list[float] = field(default_factory=list)  # all rounds
    requests: int = 0
    cpu_s: float = 0.0  # CPU time (user + system) of the server process, all rounds
    instructions: int = 0  # executed by the server process (--instructions), all rounds
    round_trips: int = 0  # Redis sends the gateway made, all rounds
    commands: int = 0  # Redis commands the server ran, all rounds

    def add(
        self,
        requests: int,
        seconds: float,
        latencies_ms: list[float],
        cpu_s: float,
        redis: tuple[int, int],
        instructions: int,
    ) -> None:
        self.rates.append(requests / seconds)
        self.latencies_ms += latencies_ms
        self.requests += requests
        self.cpu_s += cpu_s
        self.instructions += instructions
        self.round_trips += redis[0]
        self.commands += redis[1]

    def percentile(self, q: int) -> float:
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[q - 1]


async def load(
    method: str, urls: list[str], *, headers: dict[str, str], body: bytes | None, concurrency: int, seconds: float
) -> tuple[int, float, list[float], list[str]]:
    """Keep `concurrency` requests in flight for `seconds`, cycling through `urls`. Returns (requests,
    elapsed s, latencies ms, response bodies of the first requests)."""
    latencies: list[float] = []
    samples: list[str] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        deadline = time.perf_counter() + seconds

        async def client(index: int) -> None:
            turn = index
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with session.request(method, urls[turn % len(urls)], data=body) as response:
                    text = await response.text()
                    if response.status >= 300:
                        raise RuntimeError(f"{method} {urls[0]} answered {response.status}: {text}")
                latencies.append((time.perf_counter() - started) * 1000)
                if len(samples) < 10_000:
                    samples.append(text)
                turn += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    return len(latencies), elapsed, latencies, samples


# -- the run -----------------------------------------------------------------------------------------------


def cpu_seconds(process: subprocess.Popen) -> float:
    """User + system CPU time a child has used so far (Linux /proc): the server's own cost, whatever
    else the shared machine runs meanwhile."""
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Callgrind:
    """Instructions a server run under callgrind executes between `start` and `stop` (callgrind_control)."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir

    def command(self) -> list[str]:
        """The prefix that runs a server under callgrind, counting nothing until `start`."""
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self._workdir}/cg.%p"]

    def start(self, server: subprocess.Popen) -> None:
        for option in ("--zero", "--instr=on"):
            subprocess.run(["callgrind_control", option, str(server.pid)], check=True, capture_output=True)

    def stop(self, server: subprocess.Popen) -> int:
        for option in ("--instr=off", "--dump"):
            subprocess.run(["callgrind_control", option, str(server.pid)], check=True, capture_output=True)
        dump = max(self._workdir.glob(f"cg.{server.pid}*"), key=lambda path: path.stat().st_mtime)
        totals = re.search(r"^totals:\s+(\d+)", dump.read_text(), re.MULTILINE)
        assert totals is not None, f"no totals in {dump}"
        return int(totals.group(1))


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with _local.open(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # it answers (the bare server has no GET route)
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the server for {url} exited with {process.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout_s} s") from None
            time.sleep(0.1)


class RedisWork:
    """Round trips (the gateway's count) and commands (the server's commandstats) between two marks."""

    def __init__(self, client: aioredis.Redis, gateway: subprocess.Popen, count_file: Path) -> None:
        self._client, self._gateway, self._count_file = client, gateway, count_file

    async def mark(self) -> tuple[int, int]:
        self._count_file.unlink(missing_ok=True)
        self._gateway.send_signal(signal.SIGUSR1)
        while not self._count_file.exists():
            await asyncio.sleep(0.01)
        stats = await self._client.info("commandstats")
        commands = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))
        return int(self._count_file.read_text()), commands


async def run(args: argparse.Namespace, workdir: Path) -> list[Phase]:
    model_dir = workdir / "model"
    model_dir.mkdir()
    write_demo_model(model_dir)
    with RedisServer(workdir / "redis", append_only=False) as server, ExitStack() as stack:
        if args.replica:
            replica_of = ("--replicaof", "127.0.0.1", str(server.port), "--repl-diskless-sync-delay", "0")
            stack.enter_context(RedisServer(workdir / "replica", append_only=False, extra_args=replica_of))
        client = aioredis.Redis.from_url(server.url)
        while args.replica and (await client.info("replication")).get("slave0", {}).get("state") != "online":
            await asyncio.sleep(0.05)
        info = ModelInfo.from_pretrained(MODEL, model_dir)
        await publish_model(client, info, (model_dir / "tokenizer.json").read_bytes())
        api_key = await create_tenant(client, "bench")
        bare_port, gateway_port, count_file = free_port(), free_port(), workdir / "round_trips"
        here = [sys.executable, "-m", "bench.gateway"]
        gateway_args = ["--redis-url", server.url, "--port", str(gateway_port), *UNLIMITED]
        gateway_args += ["--redis-wait-replicas", "1"] if args.replica else []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        logs = (workdir / "gateway.log").open("wb")  # where a deployment's log collector would read them
        callgrind = Callgrind(workdir) if args.instructions else None
        wrapper = callgrind.command() if callgrind else []
        bare = subprocess.Popen([*wrapper, *here, "serve-bare", str(bare_port)], env=env)
        gateway = subprocess.Popen(
            [*wrapper, *here, "serve-gateway", str(count_file), *gateway_args], env=env, stderr=logs
        )
        try:
            bare_url, gateway_url = f"http://127.0.0.1:{bare_port}", f"http://127.0.0.1:{gateway_port}"
            ready_s = 600.0 if callgrind else 60.0  # a start under valgrind takes minutes
            wait_ready(f"{gateway_url}/readyz", gateway, ready_s)
            wait_ready(f"{bare_url}/", bare, ready_s)
            auth = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
            body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 16}).encode()
            common = {"concurrency": args.concurrency}
            work = RedisWork(client, gateway, count_file)
            bare_phase = Phase("bare aiohttp handler (constant 202)")
            submits, polls = Phase("POST /v1/jobs"), Phase("GET /v1/jobs/{id} (finished)")

            async def measure(
                phase: Phase, server: subprocess.Popen, method: str, urls: list[str], payload: bytes | None, s: float
            ) -> list[str]:
                before, cpu_before = await work.mark(), cpu_seconds(server)
                if callgrind:
                    callgrind.start(server)
                count, elapsed, latencies, answers = await load(
                    method, urls, headers=auth, body=payload, seconds=s, concurrency=args.concurrency
                )
                instructions = callgrind.stop(server) if callgrind else 0
                cpu = cpu_seconds(server) - cpu_before
                after = await work.mark()
                phase.add(count, elapsed, latencies, cpu, (after[0] - before[0], after[1] - before[1]), instructions)
                return answers

            # warm-up: connections, the gateway's caches and tokenizer
            for url in (f"{bare_url}/", f"{gateway_url}/v1/jobs"):
                await load("POST", [url], headers=auth, body=body, seconds=args.warmup_seconds, **common)
            poll_urls: list[str] = []
            # the box is shared: rounds alternate the handlers, so a load change hits both alike
            for _ in range(args.rounds):
                await measure(bare_phase, bare, "POST", [f"{bare_url}/"], body, args.seconds)
                answers = await measure(submits, gateway, "POST", [f"{gateway_url}/v1/jobs"], body, args.seconds)
                if not poll_urls:
                    poll_urls = await finish_jobs(client, gateway_url, answers[: args.concurrency * 4])
                    await load("GET", poll_urls, headers=auth, body=None, seconds=args.warmup_seconds, **common)
                answers = await measure(polls, gateway, "GET", poll_urls, None, args.poll_seconds)
                assert json.loads(answers[0])["status"] == "succeeded", answers[0]
            return [bare_phase, submits, polls]
        finally:
            for process in (bare, gateway):
                process.terminate()
                process.wait(10)
            await client.aclose()


async def finish_jobs(client: aioredis.Redis, gateway_url: str, answers: list[str]) -> list[str]:
    """Finish the submitted jobs (as a worker would); returns their URLs."""
    store = JobStore(client, 3600)
    job_ids = [json.loads(answer)["id"] for answer in answers]
    output = JobOutput("a story", (1, 2, 3), FinishReason.LENGTH)
    for job_id in job_ids:
        await store.start(job_id, "bench")
        await store.finish(job_id, JobStatus.SUCCEEDED, output=output, completion_tokens=3)
    return [f"{gateway_url}/v1/jobs/{job_id}" for job_id in job_ids]


def instructions_table(phases: list[Phase], args: argparse.Namespace) -> str:
    lines = [
        f"gateway instructions per request (callgrind): concurrency {args.concurrency}, {args.rounds} rounds of "
        f"{args.seconds:g} s per handler ({args.poll_seconds:g} s poll), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "| phase | requests | instructions/req | Redis round trips/req |",
        "| --- | ---: | ---: | ---: |",
    ]
    for phase in phases:
        trips = f"{phase.round_trips / phase.requests:.2f}" if phase is not phases[0] else ""
        lines.append(f"| {phase.name} | {phase.requests:,} | {phase.instructions / phase.requests:,.0f} | {trips} |")
    return "\n".join(lines)


def table(phases: list[Phase], args: argparse.Namespace) -> str:
    bare = phases[0]
    lines = [
        f"gateway benchmark: concurrency {args.concurrency}, {args.rounds} rounds of {args.seconds:g} s per handler "
        f"({args.poll_seconds:g} s poll), {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "| phase | req/s (median of rounds) | p50 ms | p99 ms | vs bare, median (min-max) of rounds (target) "
        "| server CPU µs/req | Redis round trips/req (target) | Redis commands/req |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    targets = {"POST /v1/jobs": (">= 0.50x", "<= 3"), "GET /v1/jobs/{id} (finished)": ("", "<= 1")}
    for phase in phases:
        ratio_target, trips_target = targets.get(phase.name, ("", ""))
        if phase is bare:
            ratio, trips, commands = "1.00x (baseline)", "", ""
        else:
            ratios = sorted(mine / base for mine, base in zip(phase.rates, bare.rates, strict=True))
            ratio = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
            ratio += f" ({ratio_target})" if ratio_target else ""
            trips = f"{phase.round_trips / phase.requests:.2f} ({trips_target})"
            commands = f"{phase.commands / phase.requests:.2f}"
        lines.append(
            f"| {phase.name} | {statistics.median(phase.rates):,.0f} | {phase.percentile(50):.1f} "
            f"| {phase.percentile(99):.1f} | {ratio} | {phase.cpu_s / phase.requests * 1e6:.0f} "
            f"| {trips} | {commands} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--poll-seconds", type=float, default=5.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions per request under callgrind (see above)"
    )
    parser.add_argument("--replica", action="store_true", help="a replica, and submits that wait for it (see above)")
    bare = sub.add_parser("serve-bare")
    bare.add_argument("port", type=int)
    gateway = sub.add_parser("serve-gateway")
    gateway.add_argument("count_file", type=Path)
    gateway.add_argument("gateway_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.mode == "serve-bare":
        serve_bare(args.port)
    elif args.mode == "serve-gateway":
        serve_gateway(args.count_file, args.gateway_args)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-gateway-") as workdir:
            phases = asyncio.run(run(args, Path(workdir)))
        print(instructions_table(phases, args) if args.instructions else table(phases, args))


if __name__ == "__main__":
    main()
