"""`lorafleet batch submit` and `batch get` against the real gateway app and Redis, with the test
playing the worker's part for each line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from shared import keys
from shared.jobstore import JobStore
from shared.schema import FinishReason, JobMessage, JobOutput, JobStatus, Priority, decode_job
from tests.cli.test_submit import ACME, REPO_ROOT, Gateway, Result
from tests.cli.test_submit import gateway as gateway  # the fixture, shared


async def run_lines(aredis: Redis, count: int) -> list[JobMessage]:
    """Finish the first `count` batch jobs queued for the demo model, each with its prompt's length as text."""
    store, messages, last = JobStore(aredis, 3600), [], "0-0"
    while len(messages) < count:
        for _, entries in await aredis.xread({keys.queue("demo", Priority.BATCH): last}, block=10_000) or []:
            for entry_id, fields in entries:
                last = entry_id
                message = decode_job(fields[b"job"])
                await store.start(message.job_id, "test-worker")
                output = JobOutput(f"{len(message.prompt_token_ids)} tokens", (5,), FinishReason.LENGTH)
                await store.finish(message.job_id, JobStatus.SUCCEEDED, output=output, completion_tokens=1)
                messages.append(message)
    return messages


async def lorafleet(gateway: Gateway, *args: str) -> Result:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cli", "batch", *args, "--url", gateway.url, "--api-key", gateway.api_key,
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return Result(process.returncode, out.decode(), err.decode())


async def test_batch_submit_follows_the_batch_and_batch_get_writes_its_output(
    gateway: Gateway, aredis: Redis, tmp_path: Path
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "Once upon a time", "max_tokens": 4}\n\n{"custom_id": "two", "prompt": "Hi"}\n')
    worker = asyncio.create_task(run_lines(aredis, 2))

    submitted = await lorafleet(gateway, "submit", str(requests), "--model", "demo", "--adapter", ACME.name)

    assert submitted.exit_code == 0, submitted.err
    batch_id = submitted.out.strip()
    assert batch_id.startswith("batch_") and "2/2 lines (0 failed) completed" in submitted.err
    messages = await worker
    assert {m.adapter.name for m in messages if m.adapter} == {ACME.name} and len(messages) == 2
    output = tmp_path / "out.jsonl"
    got = await lorafleet(gateway, "get", batch_id, "--output", str(output))
    assert got.exit_code == 0, got.err
    assert got.out == f"{batch_id}: completed, 2 completed, 0 failed of 2\n"
    lines: list[dict[str, Any]] = [json.loads(text) for text in output.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["line-1", "two"]


@pytest.mark.parametrize(
    ("content", "message"),
    [("", "has no lines"), ("nope\n", "not JSON"), ('{"prompt": "a"}\n{"messages": []}\n', "mixes chat")],
)
async def test_batch_submit_refuses_a_file_it_cannot_send(
    gateway: Gateway, tmp_path: Path, content: str, message: str
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(content)

    result = await lorafleet(gateway, "submit", str(requests), "--model", "demo")

    assert result.exit_code != 0 and message in result.err
