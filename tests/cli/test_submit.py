"""`lorafleet submit` against the real gateway app and Redis, with the test playing the worker's part."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from cli.demo_adapters import DEMO_ADAPTERS
from gateway.app import create_app
from shared import keys
from shared.adapter_registry import register_adapter
from shared.config import GatewayConfig
from shared.jobstore import JobStore
from shared.model_info import ModelInfo
from shared.model_registry import publish_model
from shared.schema import FinishReason, JobError, JobMessage, JobOutput, JobStatus, decode_job
from shared.tenants import create_tenant
from tests.cli.conftest import DemoFiles

REPO_ROOT = Path(__file__).resolve().parents[2]
ACME = DEMO_ADAPTERS[0]
Finish = Callable[[JobStore, JobMessage], Awaitable[Any]]


@dataclass
class Gateway:
    url: str
    api_key: str  # acme's


@pytest.fixture
async def gateway(aiohttp_server: Any, aredis: Redis, redis_url: str, demo_files: DemoFiles) -> Gateway:
    """The demo model published, tenant acme with its adapter, and a gateway serving them."""
    info = ModelInfo.from_pretrained("demo", demo_files.model.path)
    await publish_model(aredis, info, (demo_files.model.path / "tokenizer.json").read_bytes())
    api_key = await create_tenant(aredis, ACME.tenant)
    await register_adapter(
        aredis,
        name=ACME.name,
        tenant=ACME.tenant,
        model=info,
        adapter_root=demo_files.adapter_root,
        path=ACME.path("demo"),
        max_rank=64,
        max_bytes=1 << 30,
    )
    server = await aiohttp_server(create_app(GatewayConfig(redis_url=redis_url)))
    return Gateway(str(server.make_url("")).rstrip("/"), api_key)


async def act_as_worker(aredis: Redis, finish: Finish, *, run_s: float = 1.2) -> JobMessage:
    """Take the first queued job, mark it running for `run_s`, then finish it with `finish`."""
    entries = await aredis.xread({keys.queue("demo"): "0-0"}, count=1, block=10_000)
    message = decode_job(entries[0][1][0][1][b"job"])
    store = JobStore(aredis, 3600)
    await store.start(message.job_id, "test-worker")
    await asyncio.sleep(run_s)
    await finish(store, message)
    return message


def succeed(text: str) -> Finish:
    def finish(store: JobStore, message: JobMessage) -> Awaitable[bool]:
        output = JobOutput(text, (5, 6, 7), FinishReason.LENGTH)
        return store.finish(message.job_id, JobStatus.SUCCEEDED, output=output, completion_tokens=3)

    return finish


def fail(store: JobStore, message: JobMessage) -> Awaitable[bool]:
    error = JobError("adapter_load_failed", "the adapter could not be loaded")
    return store.finish(message.job_id, JobStatus.FAILED, error=error)


def cancel(store: JobStore, message: JobMessage) -> Awaitable[Any]:
    return store.cancel(message.job_id)


@dataclass
class Result:
    exit_code: int
    out: str
    err: str


async def submit(gateway: Gateway, *flags: str, prompt: str = "Once upon a time") -> Result:
    """`python -m cli submit ...` as its own process (stdout is only its own), while this loop serves the gateway."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "cli", "submit", "--url", gateway.url, "--api-key", gateway.api_key),
        *("--model", "demo", *flags, prompt),
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return Result(process.returncode, out.decode(), err.decode())


async def test_submit_prints_the_output_text_and_shows_progress_on_stderr(gateway: Gateway, aredis: Redis) -> None:
    worker = asyncio.create_task(act_as_worker(aredis, succeed("a happy ending")))
    flags = ("--adapter", ACME.name, "--max-tokens", "7", "--temperature", "0.5", "--seed", "11")
    result = await submit(gateway, *flags)

    message = await worker
    assert result.exit_code == 0, result.err
    assert result.out == "a happy ending\n"
    assert f"job {message.job_id}: queued" in result.err
    assert f"job {message.job_id}: running" in result.err
    assert message.adapter is not None and message.adapter.name == ACME.name
    sampling = message.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.seed) == (7, 0.5, 11)


async def test_submit_json_prints_the_whole_job(gateway: Gateway, aredis: Redis) -> None:
    worker = asyncio.create_task(act_as_worker(aredis, succeed("text"), run_s=0.0))
    result = await submit(gateway, "--json")

    assert result.exit_code == 0, result.err
    job = json.loads(result.out)
    assert job["id"] == (await worker).job_id
    assert (job["status"], job["output"]["text"], job["usage"]["completion_tokens"]) == ("succeeded", "text", 3)


@pytest.mark.parametrize(
    ("finish", "expected"),
    [(fail, "error: adapter_load_failed: the adapter could not be loaded"), (cancel, "error: canceled: ")],
    ids=["failed", "canceled"],
)
async def test_a_job_that_does_not_succeed_exits_1_with_its_error_code(
    gateway: Gateway, aredis: Redis, finish: Finish, expected: str
) -> None:
    worker = asyncio.create_task(act_as_worker(aredis, finish, run_s=0.0))
    result = await submit(gateway)

    await worker
    assert (result.exit_code, result.out) == (1, "")
    assert expected in result.err


async def test_a_refused_submission_exits_2_with_the_gateways_error_code(gateway: Gateway) -> None:
    result = await submit(gateway, "--adapter", "someone-elses")
    assert result.exit_code == 2
    assert "error: adapter_not_found: " in result.err


async def test_waiting_longer_than_the_timeout_exits_1_naming_the_job(gateway: Gateway) -> None:
    result = await submit(gateway, "--timeout", "0.5")
    assert result.exit_code == 1
    assert "error: timeout: job job_" in result.err
